"""The fast drafter step (split / blockwise / flex attention, chunked LM head + CE, anchor micro-batches,
activation checkpointing) equals the dense-mask reference: loss to 1e-5, every parameter
gradient to 1e-4 (relative, fp32)."""

from types import SimpleNamespace

import pytest
import torch

from flashdraft.config import ObjectiveConfig
from flashdraft.drafter import DFlashDrafter, resolve_attention
from flashdraft.drafter.attention import dense_block_mask
from flashdraft.objective import Blocks, block_input_ids, block_labels_and_weights, dflash_loss, sample_anchors
from flashdraft.target import TargetModel
from flashdraft.toy import tiny_causal_lm
from flashdraft.train.backend import Backend
from flashdraft.train.step import forward_backward
from flashdraft.train.strategy import strategy_for

VOCAB, MASK = 300, 299


def make(hidden=64, heads=4, kv_heads=2, layers=2, taps=(0, 2), seed=0, **kw):
    target = TargetModel(tiny_causal_lm(VOCAB, num_layers=4, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                                        max_position_embeddings=512, seed=seed), list(taps))
    drafter = DFlashDrafter.for_target(target, num_layers=layers, block_size=kw.pop("block_size", 4),
                                       mask_token_id=MASK, **kw)
    # large init: non-trivial attention
    drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(seed))
    return target, drafter


def batch(target, drafter, lengths, num_anchors, seed=0, full_mask=False):
    """Random sequences (right-padded), random loss masks, anchors from sample_anchors: (features,
    embedded blocks, anchors, valid, labels, weights, block token ids)."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(lengths)
    lengths = torch.tensor(lengths)
    ids = torch.randint(0, VOCAB - 1, (b, s), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) < 0.7).long() if not full_mask else torch.ones(b, s, dtype=torch.long)
    loss_mask = loss_mask * (torch.arange(s) < lengths[:, None])
    with torch.no_grad():
        features = target.features(ids, (torch.arange(s) < lengths[:, None]).long())
    anchor_seed = int(torch.randint(0, 2**31, (1,), generator=g))
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors, seed=anchor_seed)
    bs = drafter.block_size
    labels, weights = block_labels_and_weights(ids, loss_mask, lengths, anchors, valid, bs, 3.0)
    block_ids = block_input_ids(ids, anchors, bs, MASK)
    return features, target.embed(block_ids), anchors, valid, labels, weights, block_ids


def grads_of(drafter, target, inputs, **kw):
    """The trainer's micro-step (``forward_backward``) and the gradients it leaves. The dense
    oracle computes every slot (slot 0 too) of blocks embedded in full, with transformers'
    stock modules; the fast paths skip slot 0 in the last layer, get the anchors' embeddings
    plus the MASK embedding (layer 0 projects the distinct rows only) and use the lean
    custom-backward RMSNorm / RoPE / SwiGLU."""
    fast = kw.get("attention") != "dense"
    kw.setdefault("scored_only", fast)
    kw.setdefault("distinct_rows", fast)
    objective = ObjectiveConfig(loss_chunk_size=kw.pop("chunk_size", 0),
                                anchors_per_microbatch=kw.pop("anchors_per_microbatch", 0))
    selector = kw.pop("selector", None)  # DFlash2's selector term (objective.SelectorLoss)
    features, _, anchors, valid, labels, weights, block_ids = inputs
    drafter.zero_grad(set_to_none=True)
    drafter.set_lean(fast)  # the oracle runs transformers' stock RMSNorm / RoPE / MLP
    try:
        outs = forward_backward(strategy_for(drafter, target, objective), Backend(drafter), features,
                                Blocks(anchors, valid, block_ids, labels, weights, selector=selector), **kw)
    finally:
        drafter.set_lean(True)
    out = SimpleNamespace(loss=torch.stack([o.loss.detach() for o in outs]).sum(),
                          correct=torch.cat([o.correct for o in outs], dim=1))
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters()}


def assert_same(ref, fast):
    (out_r, g_r), (out_f, g_f) = ref, fast
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out_f.correct[..., 1:], out_r.correct[..., 1:])  # slot 0 is never scored
    for name, gr in g_r.items():
        err = (g_f[name] - gr).norm() / gr.norm().clamp(min=1e-12)
        assert err < 1e-4, f"{name}: relative grad error {err:.2e}"


CASES = [
    # (lengths, num_anchors, block_size, group_blocks)
    ([40], 8, 4, 0),
    ([37, 23, 12], 10, 4, 3),  # ragged batch: short rows get padded (invalid) blocks
    ([50, 50], 30, 4, 7),  # dense anchors: overlapping blocks, blocks clipped at the end
    ([19], 19, 5, 1),  # every position a candidate, N > candidates: padding
    ([64, 9], 16, 8, 0),
]


@pytest.mark.parametrize("impl", ["split", "blockwise"])
@pytest.mark.parametrize("lengths,num_anchors,block,group", CASES)
def test_fast_attention_equals_dense(lengths, num_anchors, block, group, impl):
    target, drafter = make(block_size=block, group_blocks=group, seed=len(lengths) + num_anchors)
    inputs = batch(target, drafter, lengths, num_anchors, seed=num_anchors)
    ref = grads_of(drafter, target, inputs, attention="dense")
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl))
    # chunked LM head + CE (chunks not dividing N*bs) and anchor micro-batches on top
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl, chunk_size=7, anchors_per_microbatch=3))
    # slot 0 skipped, blocks embedded in full (no distinct-rows layer 0)
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl, distinct_rows=False))


def test_blockwise_unsorted_anchors_and_mha():
    """blockwise is exact whatever the anchor order (sorting only makes it cheaper); no GQA too."""
    target, drafter = make(kv_heads=4, block_size=3, group_blocks=2)
    features, embeds, anchors, valid, labels, weights, block_ids = batch(target, drafter, [41, 30], 11, seed=7)
    order = torch.randperm(anchors.shape[1], generator=torch.Generator().manual_seed(1))
    inputs = (features, embeds[:, order], anchors[:, order], valid[:, order], labels[:, order], weights[:, order],
              block_ids[:, order])
    assert_same(grads_of(drafter, target, inputs, attention="dense"),
                grads_of(drafter, target, inputs, attention="blockwise"))


def test_random_shapes_and_knobs():
    """Random lengths / anchor counts / batch sizes / GQA ratios; every fast-path knob combined."""
    rng = torch.Generator().manual_seed(123)
    for trial in range(4):
        b = int(torch.randint(1, 4, (1,), generator=rng))
        lengths = torch.randint(6, 48, (b,), generator=rng).tolist()
        n = int(torch.randint(1, 24, (1,), generator=rng))
        block = int(torch.randint(2, 7, (1,), generator=rng))
        kv = [1, 2, 4][trial % 3]
        target, drafter = make(kv_heads=kv, block_size=block, group_blocks=trial, seed=trial, layers=1 + trial % 2)
        inputs = batch(target, drafter, lengths, n, seed=trial, full_mask=trial % 2 == 0)
        ref = grads_of(drafter, target, inputs, attention="dense")
        drafter.activation_checkpointing = trial % 2 == 1
        fast = grads_of(drafter, target, inputs, attention="auto",
                        chunk_size=int(torch.randint(1, 50, (1,), generator=rng)),
                        anchors_per_microbatch=int(torch.randint(0, n + 1, (1,), generator=rng)))
        assert_same(ref, fast)


@pytest.mark.parametrize("impl", ["dense", "split", "blockwise", "flex"])
def test_scored_only_forward_is_the_full_forward_without_slot_0(impl):
    """The last layer's slot-0 rows are skipped, not the keys they give the other slots; the
    distinct-rows input (anchor embeddings + the MASK embedding) is the same blocks."""
    target, drafter = make(block_size=5, layers=2)
    features, embeds, anchors, valid, labels, weights, _ = batch(target, drafter, [33, 21], 7, seed=5)
    mask_embed = target.embed(torch.tensor(MASK))
    assert torch.equal(embeds[:, :, 1:], mask_embed.expand_as(embeds[:, :, 1:]))  # what makes it exact
    with torch.no_grad():  # flex: forward-only on CPU (eager and unfused; it has no CPU backward)
        full = drafter(features, embeds, anchors, valid, attention=impl)
        scored = drafter(features, embeds, anchors, valid, attention=impl, scored_only=True)
        distinct = drafter(features, embeds[:, :, 0], anchors, valid, attention=impl, mask_embed=mask_embed)
    assert scored.shape == (2, 7, 4, 64)
    torch.testing.assert_close(scored, full[:, :, 1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(distinct, full, rtol=1e-5, atol=1e-6)
    loss_full = dflash_loss(full, target.lm_head.weight, labels, weights)
    loss_scored = dflash_loss(scored, target.lm_head.weight, labels, weights, chunk_size=6)
    torch.testing.assert_close(loss_scored.loss, loss_full.loss, rtol=1e-5, atol=1e-6)
    assert not loss_scored.correct[..., 0].any() and loss_scored.correct.shape == labels.shape
    assert torch.equal(loss_scored.correct[..., 1:], loss_full.correct[..., 1:])


def test_dense_reference_matches_per_block_inference():
    """The oracle itself: each valid block equals forward_block with context = features[:a]."""
    target, drafter = make(block_size=4)
    features, embeds, anchors, valid, _, _, _ = batch(target, drafter, [30, 14], 6, seed=3)
    with torch.no_grad():
        for impl in ("dense", "split", "blockwise"):
            hidden = drafter(features, embeds, anchors, valid, attention=impl)
            for bi in range(2):
                for ni in range(anchors.shape[1]):
                    if not valid[bi, ni]:
                        continue
                    a = int(anchors[bi, ni])
                    cache = drafter.new_cache()
                    if a:
                        drafter.extend_context(cache, features[bi:bi + 1, :a])
                    else:  # no context: an empty cache
                        empty = torch.zeros(1, drafter.layers[0].self_attn.num_kv_heads, 0, 16)
                        cache.keys = [empty] * len(drafter.layers)
                        cache.values = list(cache.keys)
                    ref = drafter.forward_block(cache, embeds[bi:bi + 1, ni])
                    torch.testing.assert_close(hidden[bi, ni], ref[0], rtol=1e-4, atol=1e-5)


def test_flex_forward_matches_dense_on_cpu():
    """flex_attention has no CPU backward; its forward (unfused, eager: no compiler needed, and
    torch 2.13, the pinned version, has it) checks the mask_mod. A failure here is a failure."""
    target, drafter = make(block_size=4)
    inputs = batch(target, drafter, [33, 20], 9, seed=5)
    with torch.no_grad():
        ref = drafter(*inputs[:4], attention="dense")
        fast = drafter(*inputs[:4], attention="flex")
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_resolve_attention_falls_back_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu, needs_grad=True) == "blockwise"
    assert resolve_attention("flex", cpu, needs_grad=True) == "blockwise"  # no CPU backward
    assert resolve_attention("split", cpu, needs_grad=True) == "split"
    assert resolve_attention("dense", cpu, needs_grad=True) == "dense"
    with pytest.raises(ValueError, match="use one of"):
        resolve_attention("paged", cpu, needs_grad=True)


def test_chunked_loss_equals_unchunked():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 4, 16, requires_grad=True)
    head = torch.randn(VOCAB, 16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 5, 4))
    weights = torch.rand(2, 5, 4) * (torch.rand(2, 5, 4) < 0.8)
    results = []
    for chunk in (0, 3, 16, 40):
        out = dflash_loss(h, head, labels, weights, chunk)
        gh, gw = torch.autograd.grad(out.loss, (h, head))
        results.append((out.loss.detach(), gh, gw, out.correct))
    for loss, gh, gw, correct in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gh, results[0][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, results[0][2], rtol=1e-5, atol=1e-6)
        assert torch.equal(correct, results[0][3])


def test_dense_mask_invalid_blocks_see_no_context():
    anchors = torch.tensor([[3, 5]])
    valid = torch.tensor([[True, False]])
    m = dense_block_mask(anchors, valid, 8, 2)[0, 0]
    assert m[0, :8].tolist() == [True] * 3 + [False] * 5
    assert not m[2:, :8].any()  # invalid block: no context
    assert m[2, 8:].tolist() == [False, False, True, True]


def test_config_knobs_validate():
    from flashdraft.config import DrafterConfig, ObjectiveConfig

    assert DrafterConfig().attention == "auto" and ObjectiveConfig().anchors_per_microbatch == 0
    with pytest.raises(ValueError, match="drafter.attention"):
        DrafterConfig(attention="paged")
    with pytest.raises(ValueError, match="objective.anchors_per_microbatch"):
        ObjectiveConfig(anchors_per_microbatch=-1)


def test_lean_swiglu_equals_autograd_mlp():
    """The training MLP (recomputes silu(gate) * up in backward) equals Qwen3MLP under autograd."""
    from flashdraft.drafter.kernels import swiglu

    _, drafter = make()
    mlp = drafter.layers[0].mlp
    x = torch.randn(2, 7, 64, requires_grad=True)
    ref = mlp(x)
    dy = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, *mlp.parameters()), dy)
    out = swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, (x, *mlp.parameters()), dy), ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 5])
def test_loss_under_bf16_autocast_with_a_bf16_head(chunk):
    """How the trainer runs on GPU: fp32 drafter under bf16 autocast, the target (and its LM
    head) in bf16. The chunked head writes its matmuls into buffers, which autocast skips: it
    must cast like F.linear would (it once raised a dtype mismatch), and match the unchunked loss."""
    target, drafter = make(block_size=4)
    features, embeds, anchors, valid, labels, weights, _ = batch(target, drafter, [30, 18], 6, seed=2)
    head = target.lm_head.weight.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = drafter(features, embeds[:, :, 0], anchors, valid, scored_only=True,
                         mask_embed=target.embed(torch.tensor(MASK)))
        out = dflash_loss(hidden, head, labels, weights, chunk_size=chunk)
        ref = dflash_loss(hidden, head, labels, weights)
    out.loss.backward()
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(out.loss)  # the lean final norm: in autocast's dtype
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-2, atol=1e-2)
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)


@pytest.mark.parametrize("chunk", [0, 2])
def test_correct_means_greedy_proposes_the_label_ties_go_to_the_first_index(chunk):
    """Two vocabulary rows with the same head weights tie on every logit: only the first is what
    greedy decoding (argmax) proposes."""
    torch.manual_seed(0)
    head = torch.randn(6, 8)
    head[4] = head[1]  # tokens 1 and 4 always tie
    hidden = torch.randn(1, 1, 4, 8)
    best = (hidden.reshape(4, 8) @ head.t()).argmax(-1)
    hidden[0, 0, 1:] = head[1] * 10  # slots 1..3 make token 1 (= 4) the max
    labels = torch.tensor([[[0, 1, 4, 1]]])
    out = dflash_loss(hidden, head, labels, torch.ones(1, 1, 4), chunk_size=chunk)
    assert out.correct[0, 0, 1:].tolist() == [True, False, True]
    assert bool(out.correct[0, 0, 0]) == (int(best[0]) == 0)


def test_blockwise_kept_probabilities_give_the_recomputed_gradients():
    """keep_probs (the drafter's last layer) saves the softmax for the backward instead of
    recomputing it: same output and the same gradients of q, k and v, bit for bit."""
    from dataclasses import replace

    from flashdraft.drafter.attention import BlockAttentionPlan, blockwise_attention, query_groups

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, n, bs, d = 2, 4, 2, 40, 6, 4, 16
    anchors = torch.stack([torch.randperm(s - 1, generator=g)[:n].sort().values for _ in range(b)])
    valid = torch.rand(b, n, generator=g) < 0.8
    plan = BlockAttentionPlan("blockwise", groups=query_groups(anchors, valid, s, bs, 2), num_blocks=n)
    assert len(plan.groups) == 3  # one call per group of 2 blocks: each call keeps its own probabilities
    q = torch.randn(b, hq, n * bs, d, generator=g)
    kv = [torch.randn(b, hkv, t, d, generator=g) for t in (n * bs, n * bs, s, s)]
    results = []
    for keep in (False, True):
        inputs = [t.clone().requires_grad_() for t in (q, *kv)]
        out = blockwise_attention(*inputs, replace(plan, keep_probs=keep))
        assert len(out.grad_fn.saved_tensors) == 6 + 3 * keep  # q, k/v x 2, out (+ one per call)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        results.append([out, *(t.grad for t in inputs)])
    for recomputed, kept in zip(*results):
        assert torch.equal(recomputed, kept)


def test_compiled_flex_serves_changing_batch_shapes_without_recompiling():
    """The trainer's batches change B, S (and N for short batches) every step. flex is compiled
    with dynamic shapes: a static compile recompiles per shape and, past dynamo's limit (8),
    falls back to eager flex, which materialises the whole score matrix. Counted at dynamo's
    level (graphs handed to the backend), checked against eager flex on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    from flashdraft.drafter.attention import compile_flex, flex_block_mask

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    flex = compile_flex(counting_backend)
    g = torch.Generator().manual_seed(0)
    bs, d = 4, 16
    for b, s, n in [(2, 40, 8), (2, 47, 8), (3, 52, 8), (4, 33, 8), (3, 61, 6), (2, 29, 5)]:
        anchors = torch.stack([torch.randperm(s - 1, generator=g)[:n].sort().values for _ in range(b)])
        valid = torch.rand(b, n, generator=g) < 0.8
        block_mask = flex_block_mask(anchors, valid, s, bs)  # built from the anchors: no compiler involved
        q = torch.randn(b, 4, n * bs, d, generator=g)
        k, v = (torch.randn(b, 2, s + n * bs, d, generator=g) for _ in range(2))
        torch.testing.assert_close(flex(q, k, v, block_mask=block_mask, enable_gqa=True),
                                   flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True))
    # 2, not 1: on the first call dynamo ties B to the equal KV-head count (duck sizing), and
    # B = 3 then compiles once more; every later shape reuses that graph. Static: 6.
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} compiles for 6 batch shapes"


def test_only_the_last_layer_keeps_its_probabilities_and_only_when_training(monkeypatch):
    """The drafter asks the last layer's blockwise attention to keep its probabilities (its
    backward comes first); the others recompute, and nothing is kept without autograd."""
    import flashdraft.drafter.attention as attention_module

    asked = []
    apply = attention_module._BlockwiseAttention.apply

    def spy(*args):
        asked.append(args[6])  # keep_probs
        return apply(*args)

    monkeypatch.setattr(attention_module._BlockwiseAttention, "apply", spy)
    target, drafter = make(layers=3, block_size=4)
    features, embeds, anchors, valid, labels, weights, _ = batch(target, drafter, [30, 22], 5, seed=2)
    drafter(features, embeds, anchors, valid, attention="blockwise").sum().backward()
    assert asked == [False, False, True]
    asked.clear()
    with torch.no_grad():
        drafter(features, embeds, anchors, valid, attention="blockwise")
    assert asked == [False, False, False]
