"""DFlash2 (DFLASH2.md section 1 and its closing checklist): the grouped dynamic convolution against
the fact sheet's formula, its locality and placement, the identity start, the candidate selector's
scores and walk, training against per-anchor inference, the selector term of the loss (teacher
forcing, strict top-k, D-PACE weights, schedule, stop-gradient), and the serving export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_step_equivalence import assert_same, batch, grads_of, make

from flashdraft.config import ObjectiveConfig
from flashdraft.drafter import DFlashDrafter
from flashdraft.drafter.dflash2 import CandidateSelector, DFlash2Modules, GroupedDynamicConv
from flashdraft.objective import (
    Blocks,
    SelectorLoss,
    SlotLoss,
    dflash_loss,
    dpace_weights,
    selector_schedule,
)
from flashdraft.speculative import greedy_generate, speculative_generate
from flashdraft.train.strategy import strategy_for

SIZES = DFlash2Modules(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5)


def _noisy(drafter: DFlashDrafter, seed: int = 7, scale: float = 0.15) -> DFlashDrafter:
    """Weights far from init (conv taps and selector codebooks included), so every term shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in name else
                    (torch.where(torch.arange(p.shape[1]).view(1, -1, 1) == 0, 1.0, 0.0) + 0.3 * noise
                     if name.endswith("base_kernel") else scale * noise))
    return drafter


# ---- the convolution ----------------------------------------------------------------------


def _conv_by_hand(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, side: int, gs: int, bs: int):
    """DFLASH2.md 1.2 written out, element by element: out[i, c] = sum_t (base[s, t, c] +
    delta[i, s, t, c // gs]) * x[i - t, c], x[i - t] = 0 before the block's slot 0."""
    length, hidden = x.shape
    out = torch.zeros_like(x)
    for row in range(length):
        i = row % bs  # the slot inside its block
        for c in range(hidden):
            for t in range(base.shape[1]):
                if i - t >= 0:
                    out[row, c] += (base[side, t, c] + delta[row, side, t, c // gs]) * x[row - t, c]
    return out


def test_the_conv_is_the_fact_sheets_formula_element_by_element():
    conv = GroupedDynamicConv(hidden_size=12, kernel_size=3, group_size=4, block_size=5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(2, 3, 12, generator=g))
    x, delta = torch.randn(1, 10, 12, generator=g), torch.randn(1, 10, 2, 3, 3, generator=g)  # two blocks of 5
    for side in (0, 1):
        expected = _conv_by_hand(x[0], delta[0], conv.base_kernel.detach(), side, gs=4, bs=5)
        torch.testing.assert_close(conv(x, delta, side)[0], expected)


def test_the_kernel_projection_rows_are_side_tap_group_major():
    """Output row r of kernel_projection.weight [2*K*G, H] is (side, tap, group) = divmod order."""
    conv = GroupedDynamicConv(hidden_size=8, kernel_size=2, group_size=4, block_size=4)  # G = 2: 8 rows
    x = torch.randn(1, 4, 8)
    for row in range(8):
        side, rest = divmod(row, 4)
        tap, group = divmod(rest, 2)
        with torch.no_grad():
            conv.kernel_projection.weight.zero_()
            conv.kernel_projection.weight[row, 0] = 1.0
        delta = conv.kernels(x)
        assert delta.shape == (1, 4, 2, 2, 2)
        nonzero = delta[0, 0].nonzero().tolist()
        assert nonzero == [[side, tap, group]], (row, nonzero)


def test_the_conv_never_crosses_a_block_and_slot_0_reads_tap_0_only():
    conv = GroupedDynamicConv(hidden_size=8, kernel_size=3, group_size=2, block_size=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(2, 3, 8, generator=g))
    x, delta = torch.randn(1, 12, 8, generator=g), torch.randn(1, 12, 2, 3, 4, generator=g)
    out = conv(x, delta, 0)
    changed = x.clone()
    changed[0, 4:8] += 5  # block 1
    again = conv(changed, delta, 0)
    assert torch.equal(again[0, :4], out[0, :4]) and torch.equal(again[0, 8:], out[0, 8:])  # blocks 0 and 2
    assert not torch.allclose(again[0, 4:8], out[0, 4:8])
    slot0 = (conv.base_kernel[0, 0] + delta[0, 8, 0, 0].repeat_interleave(2)) * x[0, 8]
    torch.testing.assert_close(out[0, 8], slot0)


def test_conv_sizes_the_engines_reject_are_refused():
    with pytest.raises(ValueError, match="conv_group_size=5 must divide hidden_size=64"):
        GroupedDynamicConv(64, 2, 5, 4)
    with pytest.raises(ValueError, match="conv_kernel_size=5: use 1 .. block_size"):
        GroupedDynamicConv(64, 5, 8, 4)
    with pytest.raises(ValueError, match="selector_top_k=400"):
        CandidateSelector(64, 300, 8, 400)


# ---- the identity start ---------------------------------------------------------------------


def test_a_fresh_dflash2_is_its_dflash_backbone_bit_for_bit():
    """The identity conv and the zero successor codebook survive construction and the trainer's
    reset_parameters (which re-draws every Linear): the training forward, the decode forward and
    the drafts equal the same weights' DFlash v1 drafter exactly (fp32)."""
    target, v2 = make(dflash2=SIZES)
    for conv in [m for m in v2.modules() if isinstance(m, GroupedDynamicConv)]:
        assert torch.equal(conv.kernel_projection.weight, torch.zeros_like(conv.kernel_projection.weight))
        assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
        assert not conv.base_kernel[:, 1:].any()
    selector = v2.candidate_selector
    assert not selector.successor_codebook.any() and selector.predecessor_codebook.std() > 0.1  # std=0.2 in make()
    v1 = DFlashDrafter.for_target(target, num_layers=2, block_size=4, mask_token_id=299)
    missing, unexpected = v1.load_state_dict(v2.state_dict(), strict=False)
    assert not missing and unexpected and all("conv" in k or "selector" in k for k in unexpected)
    features, embeds, anchors, valid, *_ = batch(target, v2, [30, 21], 6)
    with torch.no_grad():
        assert torch.equal(v2(features, embeds, anchors, valid, attention="dense"),
                           v1(features, embeds, anchors, valid, attention="dense"))
        cache1, cache2 = v1.new_cache(), v2.new_cache()
        v1.extend_context(cache1, features[:1, :9])
        v2.extend_context(cache2, features[:1, :9])
        hidden = v2.forward_block(cache2, embeds[:1, 0])
        assert torch.equal(hidden, v1.forward_block(cache1, embeds[:1, 0]))
        logits = target.lm_head(hidden[0, 1:])
        candidates = logits.topk(SIZES.selector_top_k).indices
        unary = logits.gather(1, candidates)
        assert torch.equal(selector.scores(hidden[0, 1:], candidates[:, 0], candidates, unary), unary)
        drafts, _ = selector.walk(hidden[0, 1:], logits, anchor=3)
        assert drafts == logits.argmax(-1).tolist()


# ---- the selector ---------------------------------------------------------------------------


def _hand_selector() -> CandidateSelector:
    """V = 6, r = 2, H = 2, top-k 3, with tables set by hand."""
    selector = CandidateSelector(hidden_size=2, vocab_size=6, rank=2, top_k=3)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.eye(2))  # P = h
        selector.predecessor_codebook.copy_(torch.tensor([[1., 0], [0, 1], [1, 1], [2, 0], [0, 2], [-1, 0]]))
        selector.successor_codebook.copy_(torch.tensor([[0., 0], [3, 0], [0, 3], [1, 1], [-2, 0], [0, -2]]))
    return selector


def test_selector_scores_are_unary_plus_the_low_rank_pair_term():
    selector = _hand_selector().requires_grad_(False)
    hidden = torch.tensor([[0.5, 2.0]])
    candidates, unary = torch.tensor([[1, 2, 4]]), torch.tensor([[0.1, 0.2, 0.3]])
    for previous in range(6):
        a = selector.predecessor_codebook[previous]
        expected = [float(unary[0, j] + sum(a[r] * hidden[0, r] * selector.successor_codebook[c, r]
                                            for r in range(2))) for j, c in enumerate(candidates[0].tolist())]
        got = selector.scores(hidden, torch.tensor([previous]), candidates, unary)[0].tolist()
        assert got == pytest.approx(expected), previous


def test_the_walk_starts_from_the_anchor_and_feeds_each_choice_forward():
    """Slot 1's predecessor is the anchor, slot k's the token chosen at k - 1: with these tables a
    walk from another anchor, or one that re-used the anchor, would choose differently."""
    selector = _hand_selector()
    logits = torch.tensor([[0.0, 1.0, 1.1, 0.0, 0.9, 0.0],  # candidates 2, 1, 4
                           [0.0, 1.0, 1.1, 0.0, 0.9, 0.0]])
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # anchor 3: A = [2, 0], P = [1, 0] -> pair [0, 6, -4] for [2, 1, 4]: token 1; then A[1] = [0, 1],
    # P = [0, 1] -> pair [3, 0, 0] for [2, 1, 4]: token 2
    assert selector.walk(hidden, logits, anchor=3)[0] == [1, 2]
    # anchor 1: A = [0, 1], P = [1, 0] -> no pair term: token 2 (top unary); then A[2] = [1, 1], P = [0, 1]: 2
    assert selector.walk(hidden, logits, anchor=1)[0] == [2, 2]
    drafts, q = selector.walk(hidden, logits, anchor=3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert q.shape == (2, 6) and torch.allclose(q.sum(-1), torch.ones(2))
    assert (q[:, [0, 3, 5]] == 0).all()  # no mass off the candidates
    first = torch.softmax(torch.tensor([1.1 + 0, 1.0 + 6, 0.9 - 4]), -1)  # anchor 3's scores over [2, 1, 4]
    torch.testing.assert_close(q[0, [2, 1, 4]], first)


# ---- training == inference --------------------------------------------------------------------


@pytest.mark.parametrize("layout", [
    {},
    {"layer_types": ["sliding_attention"] * 2, "sliding_window": 3, "causal": False},  # the released layout, W < bs
    {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 9},  # [S, S, F]
], ids=["full", "swa-bidirectional", "SSF"])
def test_training_forward_and_teacher_forced_picks_equal_per_anchor_decoding(layout):
    """One training pass over many anchors equals per-anchor decoding, for the hidden states and
    for the selector: with every label set to what the greedy walk drafts, the training term's
    teacher-forced picks reproduce the walk at every slot."""
    layers = len(layout.get("layer_types", [0, 0]))
    target, drafter = make(dflash2=SIZES, block_size=4, layers=layers, **layout)
    _noisy(drafter, scale=0.3)
    features, embeds, anchors, valid, labels, weights, block_ids = batch(target, drafter, [36, 29], 7, seed=4)
    walked = labels.clone()
    with torch.no_grad():
        trained = drafter(features, embeds, anchors, valid)
        checked = 0
        for b in range(anchors.shape[0]):
            for n in range(anchors.shape[1]):
                a = int(anchors[b, n])
                if not valid[b, n] or a == 0:
                    continue
                cache = drafter.new_cache()
                drafter.extend_context(cache, features[b:b + 1, :a])
                single = drafter.forward_block(cache, embeds[b:b + 1, n])
                torch.testing.assert_close(trained[b, n], single[0], rtol=1e-5, atol=1e-5)
                drafts, _ = drafter.candidate_selector.walk(single[0, 1:], target.lm_head(single[0, 1:]),
                                                            int(block_ids[b, n, 0]))
                walked[b, n, 1:] = torch.tensor(drafts)
                checked += 1
        assert checked >= 8
        out = dflash_loss(trained[:, :, 1:], target.lm_head.weight, walked, (weights > 0).float(),
                          selector=drafter.candidate_selector, selector_loss=SelectorLoss())
    scored = out.scored & valid.unsqueeze(-1) & (anchors > 0).unsqueeze(-1)
    assert scored.sum() > 20 and out.correct[scored].all() and out.recall[scored].all()


# ---- the selector term of the loss ------------------------------------------------------------


def _selector_term_by_hand(hidden, head, labels, weights, selector, dpace_alpha=None):
    """DFLASH2.md 1.4 written out: candidates = the head's top-k at each slot, predecessor =
    token[a + k - 1] (labels[k - 1]; the anchor for slot 1), CE over the candidates toward the
    label's index, only where the label is one (strict); weights = the base term's (D-PACE: from
    the full CE with the full validity mask)."""
    b, n, slots, _ = hidden.shape
    logits = hidden @ head.t()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, head.shape[0]), labels[:, :, 1:].reshape(-1),
                                           reduction="none").view(b * n, slots)
    flags = weights[:, :, 1:].reshape(b * n, slots)
    w = flags if dpace_alpha is None else dpace_weights(ce, flags, dpace_alpha)
    total, terms = 0.0, 0
    for row in range(b * n):
        bi, ni = divmod(row, n)
        for k in range(slots):
            y, prev = int(labels[bi, ni, k + 1]), int(labels[bi, ni, k])
            unary, cand = logits[bi, ni, k].topk(selector.top_k)
            if y not in cand.tolist() or w[row, k] == 0:
                continue
            gate = selector.hidden_projection.weight @ hidden[bi, ni, k] * selector.predecessor_codebook[prev]
            scores = unary + selector.successor_codebook[cand] @ gate
            total = total + w[row, k] * torch.nn.functional.cross_entropy(scores, torch.tensor(cand.tolist().index(y)))
            terms += 1
    return total, terms


@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("dpace", [None, 0.5])
def test_the_selector_term_is_teacher_forced_strict_and_weighted_like_the_base_term(chunk, dpace):
    torch.manual_seed(3)
    b, n, bs, h, v = 2, 3, 4, 8, 13
    selector = CandidateSelector(h, v, rank=4, top_k=4)
    with torch.no_grad():
        selector.successor_codebook.normal_()
    hidden = torch.randn(b, n, bs - 1, h, requires_grad=True)
    head = torch.randn(v, h)
    logits = hidden.detach() @ head.t()
    labels = torch.randint(0, v, (b, n, bs))
    top = logits.topk(4, -1).indices  # half the labels among the candidates, half not
    pick = torch.rand(b, n, bs - 1) < 0.5
    labels[:, :, 1:] = torch.where(pick, top[..., 1], labels[:, :, 1:])
    weights = (torch.rand(b, n, bs) > 0.2).float() * torch.tensor([0.0, 1.0, 0.7, 0.5])
    if dpace is not None:
        weights = (weights > 0).float()
    alpha = 0.6
    out = dflash_loss(hidden, head, labels, weights, chunk_size=chunk, slot_loss=SlotLoss(dpace_alpha=dpace),
                      selector=selector, selector_loss=SelectorLoss(alpha))
    sel_by_hand, terms = _selector_term_by_hand(hidden, head, labels, weights, selector, dpace)
    assert terms >= 4
    torch.testing.assert_close(out.selector_total, sel_by_hand.detach())
    base = dflash_loss(hidden, head, labels, weights, slot_loss=SlotLoss(dpace_alpha=dpace))
    normalizer = weights[:, :, 1:].sum()
    torch.testing.assert_close(out.loss, base.loss + alpha * sel_by_hand / normalizer)
    grads = torch.autograd.grad(out.loss, [hidden, *selector.parameters()])
    expected = torch.autograd.grad(base.loss + alpha * sel_by_hand / normalizer, [hidden, *selector.parameters()],
                                   allow_unused=True)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want if want is not None else torch.zeros_like(got))
    hits = torch.tensor([int(labels[bi, ni, k + 1]) in logits[bi, ni, k].topk(4).indices.tolist()
                         for bi in range(b) for ni in range(n) for k in range(bs - 1)]).view(b, n, bs - 1)
    assert torch.equal(out.recall[:, :, 1:], hits)


def test_a_label_outside_the_candidates_gives_the_selector_no_gradient():
    torch.manual_seed(0)
    selector = CandidateSelector(8, 11, rank=4, top_k=3)
    hidden, head = torch.randn(1, 1, 1, 8), torch.randn(11, 8)
    outside = int((hidden[0, 0, 0] @ head.t()).argsort()[0])  # the head's least likely token
    labels = torch.tensor([[[2, outside]]])
    out = dflash_loss(hidden, head, labels, torch.tensor([[[0.0, 1.0]]]), selector=selector,
                      selector_loss=SelectorLoss())
    out.loss.backward()
    assert out.selector_total == 0 and not out.recall.any()
    assert all(p.grad is None or not p.grad.any() for p in selector.parameters())


def test_the_selector_weight_schedule_has_specforges_edges():
    # warmup 10% then a 20% ramp over 100 steps: steps 0..9 weigh 0, ramp step j (step 9 + j) weighs j/20 alpha
    values = [selector_schedule(2.0, 0.1, 0.2, step, 100) for step in (0, 9, 10, 19, 28, 29, 30, 99)]
    assert values == pytest.approx([0.0, 0.0, 0.1, 1.0, 1.9, 2.0, 2.0, 2.0])
    assert [selector_schedule(1.0, 0.0, 0.0, step, 10) for step in (0, 9)] == [1.0, 1.0]  # the default: always on
    assert [selector_schedule(1.0, 0.5, 0.0, step, 10) for step in (4, 5)] == [0.0, 1.0]  # no ramp: a step
    # no warm-up: the ramp's first step already trains the selector (1/R of alpha), the R-th reaches alpha
    assert [selector_schedule(1.0, 0.0, 0.4, step, 10) for step in (0, 3, 4)] == pytest.approx([0.25, 1.0, 1.0])
    # fractional horizons are truncated to whole steps (T 25: W int(2.5) = 2, R int(7.5) = 7), as SpecForge does
    values = [selector_schedule(1.0, 0.1, 0.3, step, 25) for step in (1, 2, 5, 8, 9)]
    assert values == pytest.approx([0.0, 1 / 7, 4 / 7, 1.0, 1.0])


def test_stop_gradient_leaves_the_backbone_exactly_as_the_unary_only_run():
    # 120 candidates of 300: ~40% of the random labels are among them (the selector term is not empty)
    target, drafter = make(dflash2=DFlash2Modules(2, 8, 8, 120), block_size=4)
    _noisy(drafter)
    features, _, anchors, valid, labels, weights, block_ids = batch(target, drafter, [33, 20], 8, seed=2)

    def grads(selector: SelectorLoss | None, chunk: int):
        drafter.zero_grad(set_to_none=True)
        strategy = strategy_for(drafter, target, ObjectiveConfig(loss_chunk_size=chunk))
        out = strategy.forward_loss(drafter, features, Blocks(anchors, valid, block_ids, labels, weights,
                                                              selector=selector))
        out.loss.backward()
        return {k: None if p.grad is None else p.grad.clone() for k, p in drafter.named_parameters()}

    for chunk in (0, 7):
        unary = grads(None, chunk)
        detached = grads(SelectorLoss(1.0, stop_gradient=True), chunk)
        coupled = grads(SelectorLoss(1.0), chunk)
        backbone = [k for k in unary if "candidate_selector" not in k]
        assert all(torch.equal(detached[k], unary[k]) for k in backbone)
        assert not all(torch.equal(coupled[k], unary[k]) for k in backbone)  # the coupled term reaches it
        assert detached["candidate_selector.successor_codebook"].any()  # the selector itself still trains


@pytest.mark.parametrize("impl", ["split", "blockwise"])
def test_the_fast_dflash2_step_equals_the_dense_oracle(impl):
    """Chunked head (its candidates), anchor slices, the fast attention paths and the skipped
    slot 0 give the dense oracle's loss and gradients, selector term included."""
    target, drafter = make(dflash2=DFlash2Modules(2, 8, 8, 120), block_size=4, group_blocks=2)
    _noisy(drafter)
    inputs = batch(target, drafter, [37, 23], 10, seed=5)
    selector = SelectorLoss(0.7)
    ref = grads_of(drafter, target, inputs, attention="dense", selector=selector)
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl, selector=selector))
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl, selector=selector, chunk_size=7,
                              anchors_per_microbatch=3))


# ---- decoding -------------------------------------------------------------------------------


def test_dflash2_speculative_output_equals_target_greedy():
    target, drafter = make(dflash2=SIZES, block_size=4)
    _noisy(drafter, scale=0.3)
    drafter.eval()
    for start in (3, 40, 100):
        prompt = list(range(start, start + 12))
        assert speculative_generate(target, drafter, prompt, 24).tokens == greedy_generate(target, prompt, 24).tokens


# ---- the serving export -------------------------------------------------------------------------


def _walk_from_the_spec(weights: dict, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, top_k: int) -> list:
    """DFLASH2.md 1.3's greedy walk on the exported tensors by name: at slot k, the head's top-k
    candidates C and their logits u, score = u + ((W_h h_k) * A[prev]) . B[C], take the argmax,
    feed it forward; prev starts at the anchor. No module of the drafter runs here."""
    a, b = weights["candidate_selector.predecessor_codebook"], weights["candidate_selector.successor_codebook"]
    w_h = weights["candidate_selector.hidden_projection.weight"]
    previous, out = anchor, []
    for k in range(hidden.shape[0]):
        unary, cand = logits[k].topk(top_k)
        scores = unary + b[cand] @ ((w_h @ hidden[k]) * a[previous])
        previous = int(cand[scores.argmax()])
        out.append(previous)
    return out


def test_the_export_has_the_engines_keys_names_and_shapes_and_reloads_to_the_same_drafter(tmp_path):
    target, drafter = make(dflash2=SIZES, block_size=4, layer_types=["sliding_attention"] * 2, sliding_window=6,
                           causal=False)
    _noisy(drafter, scale=0.3)
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert {"block_size": 4, "mask_token_id": 299, "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8,
            "selector_top_k": 5}.items() <= cfg["dflash_config"].items()
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 6
    assert cfg["is_causal"] is False and cfg["dflash_config"]["causal"] is False
    assert not {"output_multiplier", "final_logit_softcapping", "input_embedding_scale"} & (set(cfg) |
                                                                                           set(cfg["dflash_config"]))
    weights = load_file(tmp_path / "model.safetensors")
    h, v, groups = 64, 300, 64 // 8
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert weights[f"layers.{i}.{conv}.base_kernel"].shape == (2, 2, h)
            assert weights[f"layers.{i}.{conv}.kernel_projection.weight"].shape == (2 * 2 * groups, h)
    assert weights["candidate_selector.predecessor_codebook"].shape == (v, 8)  # raw parameters: no ".weight"
    assert weights["candidate_selector.successor_codebook"].shape == (v, 8)
    assert weights["candidate_selector.hidden_projection.weight"].shape == (8, h)
    assert not [k for k in weights if k.startswith("model.") or "embed_tokens" in k or "lm_head" in k
                or k.endswith("_codebook.weight")]
    assert len(weights) == 2 * 15 + 6  # the fixture's pattern: 15 per layer and 6 global (81 for 5 layers)
    reloaded = DFlashDrafter.from_pretrained(tmp_path)
    features, embeds, anchors, valid, *_ = batch(target, drafter, [30], 5, seed=1)
    with torch.no_grad():
        assert torch.equal(reloaded(features, embeds, anchors, valid), drafter(features, embeds, anchors, valid))
        for start in (4, 10, 17):
            cache = reloaded.new_cache()
            reloaded.extend_context(cache, features[:, :start])
            hidden = reloaded.forward_block(cache, embeds[:, 0])[0, 1:]
            logits = target.lm_head(hidden)
            walked, _ = reloaded.candidate_selector.walk(hidden, logits, 5)
            assert walked == _walk_from_the_spec(weights, hidden, logits, 5, top_k=5)


@pytest.mark.parametrize("change", [
    {"dflash_config": {"conv_kernel_size": 2}},  # the other three sizes missing
    {"dflash_config": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": "5"}},
])
def test_a_dflash2_config_without_its_module_sizes_is_refused(tmp_path, change):
    target, drafter = make(dflash2=SIZES)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items()
                            if k not in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    cfg["dflash_config"].update(change["dflash_config"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="a DFlash2 drafter needs the integers dflash_config"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_the_chunked_pair_scores_equal_autograd_of_the_plain_expression(monkeypatch):
    from flashdraft.drafter import dflash2

    monkeypatch.setattr(dflash2._PairScores, "CHUNK", 3)  # 10 rows: chunks of 3, 3, 3, 1
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(10, 6, generator=g, requires_grad=True)
    book = torch.randn(9, 6, generator=g, requires_grad=True)
    candidates = torch.randint(0, 9, (10, 4), generator=g)  # repeats: the codebook rows' grads add up
    upstream = torch.randn(10, 4, generator=g)
    got = dflash2._PairScores.apply(gate, book, candidates)
    grads = torch.autograd.grad((got * upstream).sum(), [gate, book])
    plain = (book[candidates] * gate.unsqueeze(1)).sum(-1)
    expected = torch.autograd.grad((plain * upstream).sum(), [gate, book])
    torch.testing.assert_close(got, plain)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
