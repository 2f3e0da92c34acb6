"""Drafter conventions: visibility, train/infer equivalence, serving export."""

import json
import tempfile

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from conftest import MASK_ID, VOCAB, make_drafter, tiny_qwen3
from flashdraft.drafter import DFlashDrafter
from flashdraft.drafter.attention import dense_block_mask
from flashdraft.drafter.dflash2 import DFlash2Modules
from flashdraft.objective import block_input_ids, sample_anchors
from flashdraft.target import TargetModel


def _blocks(target, seed=0, batch=2, seq=40, anchors=6, bs=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (batch, seq), generator=g)
    loss_mask = torch.ones_like(ids)
    lengths = torch.full((batch,), seq)
    lengths[-1] = seq - 7
    a, valid = sample_anchors(loss_mask, lengths, anchors, seed)
    return ids, a, valid, block_input_ids(ids, a, bs, MASK_ID)


def test_mask_context_strictly_before_anchor_and_own_block_only():
    anchors = torch.tensor([[3, 5]])
    valid = torch.tensor([[True, False]])
    mask = dense_block_mask(anchors, valid, seq_len=8, block_size=2)[0, 0]
    ctx, blocks = mask[:, :8], mask[:, 8:]
    assert ctx[0].tolist() == [True, True, True, False, False, False, False, False]  # kv < 3
    assert ctx[2].sum() == 0  # padded block: no context
    assert blocks.tolist() == [[True, True, False, False], [True, True, False, False],
                               [False, False, True, True], [False, False, True, True]]


def test_training_forward_equals_single_block_inference(target, drafter):
    ids, anchors, valid, block_ids = _blocks(target)
    features = target.features(ids)
    hidden = drafter(features, target.embed(block_ids), anchors, valid)
    checked = 0
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            if not valid[b, n] or a == 0:
                continue
            cache = drafter.new_cache()
            # Incremental context: two extensions must equal one.
            drafter.extend_context(cache, features[b : b + 1, : a // 2])
            drafter.extend_context(cache, features[b : b + 1, a // 2 : a])
            single = drafter.forward_block(cache, target.embed(block_ids[b : b + 1, n]))
            torch.testing.assert_close(hidden[b, n], single[0], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked >= 8


def test_block_never_sees_context_at_or_after_its_anchor(target, drafter):
    ids, anchors, valid, block_ids = _blocks(target, seed=1)
    features = target.features(ids)
    embeds = target.embed(block_ids)
    base = drafter(features, embeds, anchors, valid)
    b, n = 0, 2
    a = int(anchors[b, n])
    perturbed = features.clone()
    perturbed[b, a:] += torch.randn_like(perturbed[b, a:])
    after = drafter(perturbed, embeds, anchors, valid)
    torch.testing.assert_close(after[b, n], base[b, n], rtol=0, atol=1e-6)
    earlier = features.clone()
    earlier[b, a - 1] += 1.0  # context before the anchor does matter
    assert not torch.allclose(drafter(earlier, embeds, anchors, valid)[b, n], base[b, n])


def test_block_never_sees_another_block(target, drafter):
    ids, anchors, valid, block_ids = _blocks(target, seed=2)
    features = target.features(ids)
    base = drafter(features, target.embed(block_ids), anchors, valid)
    changed = block_ids.clone()
    changed[0, 1:, 0] = (changed[0, 1:, 0] + 1) % (VOCAB - 1)  # other blocks' anchor tokens
    after = drafter(features, target.embed(changed), anchors, valid)
    torch.testing.assert_close(after[0, 0], base[0, 0], rtol=0, atol=1e-6)


def test_padded_blocks_see_nothing_but_themselves(target, drafter):
    ids = torch.randint(0, VOCAB - 1, (1, 12))
    anchors = torch.tensor([[4, 0]])
    valid = torch.tensor([[True, False]])
    block_ids = block_input_ids(ids, anchors, 8, MASK_ID)
    features = target.features(ids)
    base = drafter(features, target.embed(block_ids), anchors, valid)
    noisy = drafter(features + torch.randn_like(features), target.embed(block_ids), anchors, valid)
    torch.testing.assert_close(noisy[0, 1], base[0, 1], rtol=0, atol=1e-6)
    assert torch.isfinite(base).all()


def test_drafter_owns_no_embedding_or_lm_head(drafter):
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n or "rotary" in n for n in names)


def test_export_has_exactly_the_serving_names_shapes_and_config(tmp_path, target):
    drafter = make_drafter(target, num_layers=2, block_size=8)
    out = drafter.save_pretrained(tmp_path / "drafter")
    weights = load_file(out / "model.safetensors")
    h, kv, d, inter = 64, 2, 16, 128
    expected = {"norm.weight": [h], "fc.weight": [h, 3 * h], "hidden_norm.weight": [h]}
    for i in range(2):
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": [4 * d, h], p + "self_attn.k_proj.weight": [kv * d, h],
            p + "self_attn.v_proj.weight": [kv * d, h], p + "self_attn.o_proj.weight": [h, 4 * d],
            p + "self_attn.q_norm.weight": [d], p + "self_attn.k_norm.weight": [d],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
        })
    assert {k: list(v.shape) for k, v in weights.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 5], "causal": False}
    # Explicit attention keys (DFLASH2.md 3.3): every layer full and bidirectional, as vLLM and SGLang read them.
    assert cfg["layer_types"] == ["full_attention", "full_attention"] and cfg["is_causal"] is False
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
    assert cfg["tie_word_embeddings"] is False
    src = target.config.to_dict()
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters"):
        assert cfg[key] == src[key], key
    assert cfg["rope_theta"] == src["rope_parameters"]["rope_theta"]


def test_rope_scaling_is_copied_and_used():
    model = tiny_qwen3(num_layers=4)
    model.config.rope_parameters = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}
    target = TargetModel(model, [1, 2])
    drafter = make_drafter(target)
    assert drafter.config["rope_parameters"] == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}
    # the legacy fields too, for serving builds whose loaders read rope_theta / rope_scaling
    assert drafter.config["rope_theta"] == 5000.0
    assert drafter.config["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 4.0}
    expected = 1.0 / (5000.0 ** (torch.arange(0, 16, 2).float() / 16)) / 4.0
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, expected)
    with tempfile.TemporaryDirectory() as d:  # and the export loads back with the same frequencies
        drafter.save_pretrained(d)
        torch.testing.assert_close(DFlashDrafter.from_pretrained(d).rotary_emb.inv_freq, expected)


def test_rope_frequencies_stay_fp32_when_the_drafter_is_cast(tmp_path, target):
    """A bf16 drafter (``from_pretrained(dtype=bf16)``, as `flashdraft eval` loads it on GPU) rotates
    with the fp32 frequencies: cos / sin equal the fp32 drafter's to bf16 rounding of the result,
    where rounded frequencies would be ~1 radian off by position 1000."""
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "d")
    positions = torch.arange(0, 4000, 97).view(1, -1)
    cos32, sin32 = drafter.rope(positions, torch.zeros(1, dtype=torch.float32))
    for cast in (DFlashDrafter.from_pretrained(tmp_path / "d", dtype=torch.bfloat16), make_drafter(target).half()):
        assert cast.rotary_emb.inv_freq.dtype == torch.float32
        assert cast.rotary_emb.original_inv_freq.dtype == torch.float32
        cos, sin = cast.rope(positions, torch.zeros(1, dtype=next(cast.parameters()).dtype))
        torch.testing.assert_close(cos.float(), cos32, atol=8e-3, rtol=0)
        torch.testing.assert_close(sin.float(), sin32, atol=8e-3, rtol=0)


def test_save_load_gives_identical_logits(tmp_path, target):
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "d", dtype=torch.float32)
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d").eval()
    ids, anchors, valid, block_ids = _blocks(target, seed=3)
    features, embeds = target.features(ids), target.embed(block_ids)
    assert torch.equal(loaded(features, embeds, anchors, valid), drafter(features, embeds, anchors, valid))


def test_mask_token_outside_the_vocabulary_is_refused(target):
    with pytest.raises(ValueError, match="outside the target's embedding table"):
        DFlashDrafter.for_target(target, num_layers=1, block_size=8, mask_token_id=VOCAB)


@pytest.mark.parametrize("shape", [(2, 9, 32), (2, 9, 4, 16)])
def test_lean_rmsnorm_equals_qwen3_rmsnorm_values_and_grads(shape):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from flashdraft.drafter.kernels import RMSNorm

    ours, theirs = RMSNorm(shape[-1], eps=1e-6), Qwen3RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(*shape, dtype=torch.float64).float()
    dy = torch.randn(*shape)
    grads = []
    for norm in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        grads.append((y.detach(), xi.grad, norm.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    xb = x.bfloat16().requires_grad_()  # the lean path in bf16: Qwen3's rounding exactly
    assert torch.equal(ours.bfloat16()(xb), theirs.bfloat16()(xb))


def test_rope_equals_transformers_apply_rotary_pos_emb_values_and_grads():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from flashdraft.drafter.kernels import apply_rope

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    positions = torch.tensor([[0, 3, 4, 9, 10], [7, 8, 9, 10, 11]])
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = Qwen3RotaryEmbedding(cfg)(q, positions)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    results = []
    for fn in (lambda a, b: (apply_rope(a, cos, sin), apply_rope(b, cos, sin)),
               lambda a, b: apply_rotary_pos_emb(a, b, cos, sin)):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = fn(qi, ki)
        (qo * dq).sum().add((ko * dk).sum()).backward()
        results.append((qo.detach(), ko.detach(), qi.grad, ki.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _dflash_block_from_the_spec(weights: dict, cfg: dict, taps: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """One block written from DFLASH.md alone, on the exported tensors by name: ctx =
    hidden_norm(fc(taps)) at positions 0..a-1 (never through a layer's input norm); in every layer
    queries from the block only, keys / values = [k/v_proj(ctx) ; k/v_proj(block)] with the same
    weights and k_norm for both, RoPE (rotate-half, inv_freq = theta^(-2i/d)) on the queries and on
    all keys, no mask (the block sees all of ctx and itself); pre-norm SwiGLU layers; final norm.
    Sliding / causal layers (DFLASH2.md 3.1, from the config's keys): the query at position p sees
    the key at kv only if p - kv < sliding_window (sliding layers) and kv <= p (causal layers:
    is_causal when given, else exactly the sliding ones).
    DFlash2 (DFLASH2.md 1.2, when the layer has ``attention_conv`` / ``mlp_conv`` tensors): each
    sublayer's normalised input m gives the kernels delta = kernel_projection(m) viewed (side,
    tap, group); the sublayer runs on conv(m, side 0) and its output is conv(., side 1) before the
    residual add, conv(x)[i, c] = sum_t (base[s, t, c] + delta[i, s, t, c // gs]) x[i - t, c]
    over the block's own slots; the context is never convolved.
    Attention sinks (``self_attn.attention_sink_bias`` [heads]): each head's softmax runs over
    [scores, s_h], the sink's column then dropped (it has no value).
    Independent of DFlashDrafter's code: no module of it runs here."""
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, positions):  # x [T, heads, d]
        angle = positions[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        cos, sin = (torch.cat([f(angle)] * 2, -1).float()[:, None] for f in (torch.cos, torch.sin))
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def w(name):
        return weights[name]

    def conv(x, m, name, side):  # x: the block's rows [T, H]; m: the sublayer's normalised input
        if name + ".base_kernel" not in weights:
            return x  # DFlash v1: no conv
        base = w(name + ".base_kernel")  # [2, K, H]
        taps = base.shape[1]
        gs = x.shape[1] * 2 * taps // w(name + ".kernel_projection.weight").shape[0]
        delta = (m @ w(name + ".kernel_projection.weight").T).view(-1, 2, taps, x.shape[1] // gs)
        out = torch.zeros_like(x)
        for t in range(taps):
            shifted = torch.cat([torch.zeros(t, x.shape[1]), x[:x.shape[0] - t]])  # x[i - t], 0 before slot 0
            out = out + (base[side, t] + delta[:, side, t].repeat_interleave(gs, dim=1)) * shifted
        return out

    ctx = rms(taps @ w("fc.weight").T, w("hidden_norm.weight"))
    a, t = ctx.shape[0], block.shape[0]
    pos_ctx, pos_blk = torch.arange(a), torch.arange(a, a + t)
    x = block
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        m = rms(x, w(p + "input_layernorm.weight"))
        h = conv(m, m, p + "attention_conv", 0)

        def keys(src, pos, p=p):
            k = (src @ w(p + "self_attn.k_proj.weight").T).view(-1, nkv, d)
            return rope(rms(k, w(p + "self_attn.k_norm.weight")), pos)

        q = (h @ w(p + "self_attn.q_proj.weight").T).view(t, nh, d)
        q = rope(rms(q, w(p + "self_attn.q_norm.weight")), pos_blk)
        k = torch.cat([keys(ctx, pos_ctx), keys(h, pos_blk)]).repeat_interleave(nh // nkv, dim=1)
        v = torch.cat([ctx, h]) @ w(p + "self_attn.v_proj.weight").T
        v = v.view(-1, nkv, d).repeat_interleave(nh // nkv, dim=1)
        kind = cfg.get("layer_types", ["full_attention"] * cfg["num_hidden_layers"])[i]
        causal = cfg["is_causal"] if cfg.get("is_causal") is not None else kind == "sliding_attention"
        distance = pos_blk[:, None] - torch.cat([pos_ctx, pos_blk])[None, :]  # query - key position
        visible = torch.ones_like(distance, dtype=torch.bool)
        if kind == "sliding_attention":
            visible &= distance < cfg["sliding_window"]
        if causal:
            visible &= distance >= 0
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        if p + "self_attn.attention_sink_bias" in weights:  # a sink: one more column per head, no value
            sink = w(p + "self_attn.attention_sink_bias").view(nh, 1, 1).expand(nh, t, 1)
            attn = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", attn, v).reshape(t, nh * d) @ w(p + "self_attn.o_proj.weight").T
        x = x + conv(out, m, p + "attention_conv", 1)
        m = rms(x, w(p + "post_attention_layernorm.weight"))
        hm = conv(m, m, p + "mlp_conv", 0)
        gate, up = hm @ w(p + "mlp.gate_proj.weight").T, hm @ w(p + "mlp.up_proj.weight").T
        x = x + conv((torch.nn.functional.silu(gate) * up) @ w(p + "mlp.down_proj.weight").T, m, p + "mlp_conv", 1)
    return rms(x, w("norm.weight"))


@pytest.mark.parametrize("layout", [
    {},  # DFlash v1: full, bidirectional
    {"layer_types": ["sliding_attention"] * 2, "sliding_window": 5, "causal": False},  # DFlash2's layout, W < bs
    {"layer_types": ["sliding_attention"] * 2, "sliding_window": 12},  # causal by type, W >= bs
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},  # [S, F], mixed causality
    {"causal": True},  # full layers, causal in-block
    {"dflash2": DFlash2Modules(2, 8, 8, 5)},  # DFlash2: the conv around every sublayer
    {"dflash2": DFlash2Modules(3, 16, 8, 5), "layer_types": ["sliding_attention"] * 2, "sliding_window": 5,
     "causal": False},  # DFlash2's released layout
    {"sinks": True, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},  # sinks
], ids=["v1", "swa-bidirectional", "swa-causal", "mixed", "full-causal", "dflash2", "dflash2-swa", "sinks"])
def test_the_exported_drafter_computes_what_dflash_md_specifies(target, tmp_path, layout):
    """Golden test against an independent implementation of the architecture (above), so that a
    convention broken in code the training and inference paths share (fusion, KV injection, RoPE
    on the context keys, no input norm on the context, the layers' windows and causality) cannot
    pass by agreeing with itself."""
    drafter = DFlashDrafter.for_target(target, num_layers=2, block_size=8, mask_token_id=MASK_ID, **layout)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # weights far from init, norms included, so every term shows
        for name, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.15 * noise + ("base_kernel" in name))
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(tmp_path / "model.safetensors")
    ids, anchors, valid, block_ids = _blocks(target, seed=3)
    features = target.features(ids)
    with torch.no_grad():
        trained = drafter(features, target.embed(block_ids), anchors, valid)  # the training forward, all blocks
        checked = 0
        for n in range(anchors.shape[1]):
            a = int(anchors[0, n])
            if not valid[0, n] or a == 0:
                continue
            expected = _dflash_block_from_the_spec(weights, cfg, features[0, :a], target.embed(block_ids[0, n]))
            cache = drafter.new_cache()
            drafter.extend_context(cache, features[:1, :a])
            torch.testing.assert_close(drafter.forward_block(cache, target.embed(block_ids[:1, n]))[0], expected,
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(trained[0, n], expected, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("change", [
    {"layer_types": ["chunked_attention", "full_attention"]},
    {"layer_types": ["full_attention"]},  # one entry for two layers
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None},
    {"dflash_config": {"attention_value_scale": 0.707}},  # MiMo's value scale
    {"final_logit_softcapping": 30.0},
])
def test_loading_a_drafter_with_layers_flashdraft_does_not_implement_is_refused(target, tmp_path, change):
    """Newer public DFlash checkpoints may use value scales, scaled outputs or other layer
    kinds; silently loading them as the layers implemented here would evaluate another drafter."""
    drafter = make_drafter(target, num_layers=2)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError,
                       match=r"config.json: this DFlash drafter uses what flashdraft does not implement"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_block_size_may_live_in_dflash_config_only(target, tmp_path):
    make_drafter(target, block_size=8).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    block_size = cfg.pop("block_size")
    cfg["dflash_config"]["block_size"] = block_size
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert DFlashDrafter.from_pretrained(tmp_path).block_size == 8


def test_a_crash_mid_export_leaves_the_previous_export_whole(target, tmp_path, monkeypatch):
    import flashdraft.drafter.serving as serving

    make_drafter(target, seed=1).save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def torn(state, filename, metadata=None):  # the disk fills up half-way through the weights
        with open(filename, "wb") as f:
            f.write(b"torn")
        raise OSError("No space left on device")

    monkeypatch.setattr(serving, "save_file", torn)
    with pytest.raises(OSError, match="No space"):
        make_drafter(target, seed=2).save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary file left either
    DFlashDrafter.from_pretrained(tmp_path)


def test_a_tampered_drafter_config_is_refused_before_anything_is_allocated(target, tmp_path):
    """config.json edited to intermediate_size 1e9 (128 GB of fp32 weights) used to allocate first
    and compare shapes after; a size within bounds but not the file's is found in the safetensors
    header, before the weights are built. The eval runs under an address-space cap of 4 GiB more
    than this process holds (an allocation of the tampered size fails instead of the machine)."""
    import resource

    from flashdraft.cli import main
    from flashdraft.evaluate import write_prompts

    target.model.save_pretrained(tmp_path / "target")
    make_drafter(target, num_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    write_prompts(tmp_path / "prompts.jsonl", [[1, 2, 3]])
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({**config, "intermediate_size": 1_000_000_000}))
    held = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize:")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (held + 4 * 2**30, hard))
    try:
        with pytest.raises(ValueError, match=r"drafter/config.json: intermediate_size=1000000000 is invalid: a size is "
                                             r"a whole number from 1 to"):
            main(["eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts",
                  str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "2", "--device", "cpu"])
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({**config, "intermediate_size": 3 * 64}))
    with pytest.raises(ValueError, match=r"model.safetensors does not fit its config.json \(size mismatch for "
                                         r"layers.0.mlp.\w+_proj.weight: \[\d+, \d+\] in the file, \[\d+, \d+\] from "
                                         r"config.json\)"):
        DFlashDrafter.from_pretrained(tmp_path / "drafter")
