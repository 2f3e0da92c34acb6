"""DFlashDrafter: the block-diffusion drafter, and its serving-format save / load.

Architecture (DFLASH.md): Qwen3-style pre-norm decoder layers whose keys/values are
``[proj(ctx) ; proj(block)]`` ("KV injection": same k_proj / v_proj / k_norm for both parts,
RoPE on all keys and on the queries), where ``ctx = hidden_norm(fc(concat(taps)))`` is fused
once per forward and never updated between layers. Queries come only from the block. The
drafter owns no embedding and no LM head: callers embed block tokens with the target's
``embed`` and score ``norm(h)`` with the target's ``lm_head``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

# Target config fields copied into the drafter's config.json (faithfully: a RoPE mismatch
# silently destroys acceptance at serving time).
_COPIED_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "attention_bias", "attention_dropout", "rope_theta", "rope_scaling",
    "rope_parameters", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range",
)
# RoPE settings of a hybrid target's OWN attention that the drafter (plain Qwen3 attention: every
# head dim rotated, 1-D positions) does not use. Copied, they would make the config say one thing
# and training do another: vLLM and SGLang read partial_rotary_factor (Qwen3-Next / Qwen3.5: 0.25)
# and would rotate a quarter of each head, while transformers' Qwen3 rotary, which the drafter
# trains with, rotates all of it.
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def drafter_config_from_target(
    target_config, *, num_layers: int, block_size: int, mask_token_id: int, target_layer_ids: list[int]
) -> dict:
    """The drafter's config.json as a dict: the target's Qwen3 fields + the DFlash keys."""
    src = target_config.to_dict()
    cfg = {key: src[key] for key in _COPIED_FIELDS if key in src}
    cfg.setdefault("head_dim", src["hidden_size"] // src["num_attention_heads"])
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict):
            cfg[key] = {k: v for k, v in cfg[key].items() if k not in _TARGET_ONLY_ROPE_KEYS}
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # older loaders read the top-level field
    if "rope_scaling" not in cfg and rope.get("rope_type", "default") != "default":
        # ... and their scaling (YaRN, linear, llama3) from rope_scaling, in its legacy form
        cfg["rope_scaling"] = {"type": rope["rope_type"], **{k: v for k, v in rope.items() if k != "rope_theta"}}
    cfg.setdefault("attention_bias", False)
    cfg.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=num_layers,
        num_target_layers=int(src["num_hidden_layers"]),
        block_size=block_size,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids)},
        layer_types=["full_attention"] * num_layers,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if not 0 <= mask_token_id < cfg["vocab_size"]:
        raise ValueError(
            f"model.mask_token_id={mask_token_id} is outside the target's embedding table (vocab_size "
            f"{cfg['vocab_size']}): set model.mask_token_id to an unused id in [0, {cfg['vocab_size'] - 1}] "
            "(Qwen3: 151669), or add a mask token to the tokenizer and resize the target's embeddings"
        )
    return cfg


def _qwen3_config(cfg: dict) -> Qwen3Config:
    keys = set(_COPIED_FIELDS) | {"num_hidden_layers", "layer_types"}
    # deep copies: Qwen3Config standardises rope dicts in place, which would change what we save
    return Qwen3Config(**{k: copy.deepcopy(v) for k, v in cfg.items() if k in keys and v is not None})


def dense_block_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Bool attention mask [B, 1, Q, S + Q] over [context | all blocks] (Q = N * bs).

    A valid block anchored at a sees context positions j < a and its own bs slots. A padded
    (invalid) block sees only its own slots (so its softmax stays finite; it has zero weight).
    """
    b, n = anchors.shape
    q = n * block_size
    ctx_pos = torch.arange(seq_len, device=anchors.device)
    limit = torch.where(valid, anchors, torch.zeros_like(anchors))  # invalid blocks: no context
    sees_ctx = ctx_pos.view(1, 1, 1, -1) < limit.view(b, n, 1, 1)  # [B, N, 1, S]
    sees_ctx = sees_ctx.expand(b, n, block_size, seq_len).reshape(b, q, seq_len)
    block_id = torch.arange(q, device=anchors.device) // block_size
    same_block = (block_id.view(-1, 1) == block_id.view(1, -1)).expand(b, q, q)
    return torch.cat([sees_ctx, same_block], dim=-1).unsqueeze(1)


ATTENTION_IMPLS = ("auto", "dense", "split", "blockwise", "flex")


def resolve_attention(impl: str, device: torch.device, needs_grad: bool) -> str:
    """Pick the concrete training-attention implementation for ``impl`` on ``device``.

    "auto": "flex" on CUDA when flex_attention imports (block-sparse, fused, one kernel per
    layer), else "blockwise" (groups of blocks over their context prefix, matmuls). "flex"
    asked for where it cannot run backward (CPU with grad) falls back to "blockwise":
    flex_attention has no CPU backward.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {impl!r} unknown: use one of {', '.join(ATTENTION_IMPLS)}")
    if impl in ("auto", "flex"):
        if device.type == "cuda" and _flex_available():
            return "flex"
        if impl == "flex" and not needs_grad:
            return "flex"  # forward-only flex runs (unfused) on CPU: used by the tests
        return "blockwise"
    return impl


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class BlockAttentionPlan:
    """How each layer's block queries [B, Hq, Q, D] attend, built once per training forward.

    dense: ``mask`` [B, 1, Q, S + Q] over [context | all blocks] (the oracle).
    split: blocks in ``num_groups`` groups of ``group_blocks`` consecutive blocks (N padded to
      num_groups * group_blocks), groups folded into the batch: one SDPA over
      [B * num_groups, H, g*bs queries, S + g*bs keys] where a group's keys are [context | the
      group's own slots] and ``mask`` [B * num_groups, 1, g*bs, S + g*bs] keeps j < anchor and
      the block's own slots. Work per query is S + g*bs instead of S + N*bs; no host sync.
    blockwise: ``groups``, consecutive blocks (anchors sorted ascending) whose queries attend
      [context prefix up to the group's last anchor | the group's own slots]: a block's work is
      ~ its group's last anchor + g*bs keys instead of S + N*bs (see blockwise_attention).
    flex: ``block_mask`` a flex_attention BlockMask over [context | all blocks]; tiles the
      mask excludes are skipped by the kernel.

    ``keep_probs`` (blockwise): save each group's softmax probabilities for the backward
    instead of recomputing them from q and k (one score matmul and one softmax fewer; memory:
    ~ heads * Q * (mean context + group rows) floats, until the backward).
    """

    impl: str
    keep_probs: bool = False
    mask: torch.Tensor | None = None
    group_blocks: int = 0
    num_groups: int = 0
    num_blocks: int = 0
    block_mask: object = None
    groups: list["QueryGroup"] = field(default_factory=list)


def split_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int, group_blocks: int) -> torch.Tensor:
    """Bool mask [B * G, 1, g*bs, S + g*bs] of the "split" attention (G = ceil(N / g) groups).

    Row r of group gi is slot r % bs of block gi*g + r // bs: it sees context j < anchor (none
    for padded blocks and for the pad blocks added to fill the last group) and the slots of its
    own block. Every row sees at least its own slots, so no softmax row is empty.
    """
    b, n = anchors.shape
    num_groups = -(-n // group_blocks)
    limit = torch.where(valid, anchors, torch.zeros_like(anchors)).clamp(max=seq_len)
    limit = F.pad(limit, (0, num_groups * group_blocks - n))  # [B, G*g]
    gq = group_blocks * block_size
    limit = limit.view(b * num_groups, group_blocks, 1).expand(-1, -1, block_size).reshape(-1, gq, 1)
    sees_ctx = torch.arange(seq_len, device=anchors.device).view(1, 1, -1) < limit  # [B*G, gq, S]
    block_id = torch.arange(gq, device=anchors.device) // block_size
    same_block = (block_id.view(-1, 1) == block_id.view(1, -1)).expand(b * num_groups, gq, gq)
    return torch.cat([sees_ctx, same_block], dim=-1).unsqueeze(1)


def split_attention(q, k_blk, v_blk, k_ctx, v_ctx, plan: BlockAttentionPlan, enable_gqa: bool) -> torch.Tensor:
    """The "split" attention (see BlockAttentionPlan): q [B, Hq, Q, D], block k/v [B, Hkv, Q, D],
    context k/v [B, Hkv, S, D] -> [B, Hq, Q, D]; equals the dense-mask attention exactly."""
    b, hq, q_len, d = q.shape
    hkv, s = k_ctx.shape[1], k_ctx.shape[2]
    g, gq = plan.num_groups, plan.group_blocks * (q_len // plan.num_blocks)
    pad = g * gq - q_len

    def grouped(t):  # [B, H, Q, D] -> [B, G, H, gq, D]
        t = F.pad(t, (0, 0, 0, pad)) if pad else t
        return t.view(b, t.shape[1], g, gq, d).transpose(1, 2)

    def keys(ctx, blk):  # [B*G, H, S + gq, D]: the context repeated per group, then the group's slots
        ctx = ctx.unsqueeze(1).expand(b, g, hkv, s, d)
        return torch.cat([ctx, grouped(blk)], dim=3).reshape(b * g, hkv, s + gq, d)

    out = F.scaled_dot_product_attention(
        grouped(q).reshape(b * g, hq, gq, d), keys(k_ctx, k_blk), keys(v_ctx, v_blk),
        attn_mask=plan.mask, enable_gqa=enable_gqa,
    )
    out = out.view(b, g, hq, gq, d).transpose(1, 2).reshape(b, hq, g * gq, d)
    return out[:, :, :q_len] if pad else out


@dataclass
class QueryGroup:
    """``groups`` groups of whole blocks, together rows ``start:stop`` of the block queries, that
    attend side by side (one batched matmul): each group its keys [context[:context] | its own
    slots] under ``bias`` [B, 1, groups, 1, rows, context + rows], 0 where a key is visible and
    -inf where not (context j >= the row's anchor, another block's slot). An additive bias, not a
    bool mask: masked_fill_ with a broadcast mask is ~30x slower than add_ on CPU (measured)."""

    start: int
    stop: int
    context: int
    groups: int
    bias: torch.Tensor


def query_groups(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int, group_blocks: int,
                 groups_per_call: int = 1, dtype: torch.dtype = torch.float32) -> list[QueryGroup]:
    """The "blockwise" plan: groups of ``group_blocks`` consecutive blocks, ``groups_per_call`` of
    them per batched call, context cut at the call's largest anchor over the batch (one host
    sync, for the key lengths). Exact whatever the anchor order; cheapest with sorted anchors
    (sample_anchors sorts them). Small groups waste fewer block keys; several per call keep
    the number of (CPU-thread-synchronising) ops per layer low."""
    b, n = anchors.shape
    limit = torch.where(valid, anchors, torch.zeros_like(anchors)).clamp(max=seq_len)  # padded blocks: no context
    spans, first = [], 0  # (first block, groups, blocks per group)
    while first < n:
        k = min(groups_per_call, (n - first) // group_blocks)
        spans.append((first, k, group_blocks) if k else (first, 1, n - first))
        first += spans[-1][1] * spans[-1][2]
    lengths = torch.stack([limit[:, i:i + k * g].amax() for i, k, g in spans]).tolist()
    calls = []
    for (i, k, g), length in zip(spans, lengths):
        rows = g * block_size
        row_limit = limit[:, i:i + k * g].view(b, k, g).repeat_interleave(block_size, dim=2).unsqueeze(-1)
        sees_ctx = torch.arange(length, device=anchors.device) < row_limit  # [B, k, rows, L]
        block_id = torch.arange(rows, device=anchors.device) // block_size
        same_block = (block_id.view(-1, 1) == block_id.view(1, -1)).expand(b, k, rows, rows)
        bias = torch.cat([torch.where(sees, 0.0, float("-inf")) for sees in (sees_ctx, same_block)], dim=-1)
        calls.append(QueryGroup(i * block_size, (i + k * g) * block_size, length, k,
                                bias.to(dtype).view(b, 1, k, 1, rows, -1)))
    return calls


def _to_groups(t: torch.Tensor, g: QueryGroup, kv_heads: int) -> torch.Tensor:
    """Rows g.start:g.stop of t [B, H, Q, D] -> [B, Hkv, groups, H/Hkv * rows, D]: the query
    heads that share a KV head stacked as rows, so GQA needs no repeated K/V."""
    b, h, _, d = t.shape
    t = t[:, :, g.start:g.stop].reshape(b, kv_heads, h // kv_heads, g.groups, -1, d)
    return t.transpose(2, 3).reshape(b, kv_heads, g.groups, -1, d)


def _from_groups(x: torch.Tensor, dst: torch.Tensor, g: QueryGroup) -> None:
    """Write x [B, Hkv, groups, H/Hkv * rows, D] into rows g.start:g.stop of dst [B, H, Q, D]."""
    b, h, _, d = dst.shape
    hkv = x.shape[1]
    x = x.reshape(b, hkv, g.groups, h // hkv, -1, d).transpose(2, 3)
    dst[:, :, g.start:g.stop].view(b, hkv, h // hkv, g.groups, -1, d).copy_(x)


def _group_kv(ctx: torch.Tensor, blk: torch.Tensor, g: QueryGroup) -> torch.Tensor:
    """Each group's keys (or values) [B, Hkv, groups, context + rows, D]."""
    b, hkv, _, d = ctx.shape
    prefix = ctx[:, :, None, :g.context].expand(b, hkv, g.groups, g.context, d)
    return torch.cat([prefix, _to_groups(blk, g, hkv)], dim=3)


def _group_probs(qg: torch.Tensor, kg: torch.Tensor, g: QueryGroup) -> torch.Tensor:
    """Attention probabilities [B, Hkv, groups, rep * rows, context + rows] (qg pre-scaled)."""
    s = qg @ kg.transpose(-1, -2)
    b, hkv, k, _, keys = s.shape
    s.view(b, hkv, k, -1, g.bias.shape[-2], keys).add_(g.bias)
    return torch.softmax(s, dim=-1)


class _BlockwiseAttention(torch.autograd.Function):
    """Softmax attention of each group over its own keys, calls of groups one after another.

    Saved: q, k, v and the output, plus each call's probabilities with ``keep_probs`` (else the
    backward recomputes them per call); no score matrix of another call, no per-group K/V copy
    outlives its loop iteration, no repeated KV heads. Every query row sees its own slots, so
    no row is empty.
    """

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, calls, keep_probs):
        hkv = k_ctx.shape[1]
        out, q_scaled = torch.empty_like(q), q * q.shape[-1] ** -0.5
        probs = []
        for g in calls:
            p = _group_probs(_to_groups(q_scaled, g, hkv), _group_kv(k_ctx, k_blk, g), g)
            _from_groups(p @ _group_kv(v_ctx, v_blk, g), out, g)
            if keep_probs:
                probs.append(p)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, out, *probs)
        ctx.calls = calls
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_ctx, v_ctx, k_blk, v_blk, out, *probs = ctx.saved_tensors
        hkv = k_ctx.shape[1]
        scale = q.shape[-1] ** -0.5
        dq, dk_blk, dv_blk = torch.empty_like(q), torch.empty_like(k_blk), torch.empty_like(v_blk)
        dk_ctx, dv_ctx = torch.zeros_like(k_ctx), torch.zeros_like(v_ctx)
        delta = (dout * out).sum(-1, keepdim=True)  # sum_j p_j dp_j, per query row
        q_scaled = q * scale
        for i, g in enumerate(ctx.calls):
            qg, kg, vg = _to_groups(q_scaled, g, hkv), _group_kv(k_ctx, k_blk, g), _group_kv(v_ctx, v_blk, g)
            p = probs[i] if probs else _group_probs(qg, kg, g)
            do = _to_groups(dout, g, hkv)
            ds = (do @ vg.transpose(-1, -2)).sub_(_to_groups(delta, g, hkv)).mul_(p)
            dv = p.transpose(-1, -2) @ do
            dk = ds.transpose(-1, -2) @ qg
            _from_groups((ds @ kg).mul_(scale), dq, g)
            n = g.context
            dk_ctx[:, :, :n] += dk[:, :, :, :n].sum(2)
            dv_ctx[:, :, :n] += dv[:, :, :, :n].sum(2)
            _from_groups(dk[:, :, :, n:], dk_blk, g)
            _from_groups(dv[:, :, :, n:], dv_blk, g)
        return dq, dk_ctx, dv_ctx, dk_blk, dv_blk, None, None


def blockwise_attention(q, k_blk, v_blk, k_ctx, v_ctx, plan: BlockAttentionPlan) -> torch.Tensor:
    """The "blockwise" attention (see BlockAttentionPlan): q [B, Hq, Q, D], block k/v
    [B, Hkv, Q, D], context k/v [B, Hkv, S, D] -> [B, Hq, Q, D]; equals the dense-mask
    attention exactly (one softmax over each row's allowed keys; the keys cut away are masked).
    Under autocast its inputs are cast to the autocast dtype and it runs with autocast off (its
    backward runs outside autocast, so mixed dtypes would meet there)."""
    tensors, calls = (q, k_ctx, v_ctx, k_blk, v_blk), plan.groups
    with autocast_suspended(q.device.type) as dtype:
        if dtype is not None:
            tensors = [t.to(dtype) for t in tensors]
            calls = [replace(g, bias=g.bias.to(dtype)) for g in calls]
        keep = plan.keep_probs and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return _BlockwiseAttention.apply(*tensors, calls, keep)


def flex_block_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int):
    """flex_attention BlockMask over keys [context S | all N*bs slots], same pattern as dense_block_mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    q = n * block_size
    limit = torch.where(valid, anchors, torch.zeros_like(anchors))

    def mask_mod(bi, hi, q_idx, kv_idx):
        blk = q_idx // block_size
        sees_ctx = kv_idx < limit[bi, blk]  # limit <= S, so this is inside the context part
        own = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == blk)
        return sees_ctx | own

    return create_block_mask(mask_mod, b, None, q, seq_len + q, device=anchors.device)


_compiled_flex = None

# Compiles of flex_attention allowed per process (dynamo's default is 8). A batch of size 1 and
# grad / no-grad (training / eval) are compiled apart even with dynamic shapes; past the limit
# dynamo would run flex eagerly, which materialises the whole score matrix (OOM at 8B sizes).
FLEX_RECOMPILE_LIMIT = 64


def compile_flex(backend: str = "inductor"):
    """flex_attention compiled with dynamic shapes. The trainer's batches change B and S from
    step to step; a static compile (``dynamic=False``) recompiles for every new shape and, past
    dynamo's recompile limit, silently falls back to eager flex. Dynamic: one compile serves
    every S, B and N (tests/test_step_equivalence.py counts them)."""
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=True, backend=backend)


def _flex_attention(q, k, v, block_mask, enable_gqa):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)  # unfused, tests only
    if _compiled_flex is None:
        _compiled_flex = compile_flex()  # once per process: eager flex materialises the full score matrix
    with autocast_suspended(q.device.type) as dtype:
        # One dtype for q, k and v, as autocast would give a matmul: under autocast the stock
        # q / k norms return fp32 while v is bf16, and the compiled kernel gets what it is given.
        if dtype is not None:
            q, k, v = (t.to(dtype) for t in (q, k, v))
        try:
            return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # a compile / Triton failure on this GPU and torch: name the way out
            raise RuntimeError(
                f"the drafter's compiled flex_attention failed on {torch.cuda.get_device_name(q.device)} "
                f"(torch {torch.__version__}, q {tuple(q.shape)} {q.dtype}): {type(exc).__name__}: {exc}. "
                "Set model.drafter_attention=blockwise to train with the exact matmul attention instead "
                "(slower, more memory), and report the error"
            ) from exc


def _use_lean(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module`` (RMSNorm, DrafterAttention, DrafterLayer) takes its lean custom-backward
    path for input ``x``: switched on (``lean``), training, and no autocast (the custom backwards
    assume one dtype; autocast gets transformers' stock modules)."""
    return module.lean and torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)


@contextlib.contextmanager
def autocast_suspended(device_type: str):
    """Yields the autocast dtype (None when autocast is off) and turns autocast off inside: for
    custom autograd Functions, whose backward runs outside autocast and whose ``out=`` matmuls
    autocast skips. The caller casts the inputs to the yielded dtype, as autocast would have."""
    if not torch.is_autocast_enabled(device_type):
        yield None
        return
    dtype = torch.get_autocast_dtype(device_type)
    with torch.autocast(device_type, enabled=False):
        yield dtype


class _RMSNormFn(torch.autograd.Function):
    """Qwen3's RMSNorm, w * (x * rsqrt(mean(x^2) + eps)), saving x and the per-row scale only
    and computing the backward with two full-size fp32 temporaries for fp32 x (autograd's
    graph keeps x^2 and x * r and makes ~6; lower-precision x adds its fp32 copies). Same
    values (fp32 inside, as Qwen3RMSNorm)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xhat = x.float() * r
        u = dy.float() * xhat
        dw = u.sum(dim=tuple(range(u.dim() - 1))).to(weight.dtype) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, dw, None
        u = torch.mul(dy, weight, out=u)  # dL/dxhat
        mean = torch.linalg.vecdot(u, xhat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        dx = xhat.mul_(mean).neg_().add_(u).mul_(r)  # r * (u - xhat * mean(u * xhat))
        return dx.to(x.dtype), dw, None


class RMSNorm(Qwen3RMSNorm):
    """Qwen3RMSNorm (same weights and values) with a leaner training backward (_RMSNormFn);
    ``lean = False``: Qwen3RMSNorm's own forward always (the oracle's way)."""

    lean = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_lean(self, x):
            return _RMSNormFn.apply(x, self.weight, self.variance_epsilon)
        return super().forward(x)


class _Rope(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin for x [B, H, T, D] and cos / sin [B, T, D], written into
    one output (the plain expression allocates five tensors of x's size); cos / sin get no grad."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ctx.save_for_backward(cos, sin)
        h = x.shape[-1] // 2
        out = x * cos
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        h = dy.shape[-1] // 2
        dx = dy * cos
        dx[..., :h].addcmul_(dy[..., h:], sin[..., h:])
        dx[..., h:].addcmul_(dy[..., :h], sin[..., :h], value=-1)
        return dx, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lean: bool = True) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, D] at the positions of cos / sin [B, T, D] (``lean``:
    one output tensor; else transformers' expression)."""
    if lean:
        return _Rope.apply(x, cos, sin)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class RotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding whose frequencies stay fp32 when the module is cast (``.to(bf16)``,
    ``.half()``): a cast would round them, and by position 1000 a bf16-rounded frequency is ~1
    radian off, so a drafter cast for inference would rotate q / k unlike training and serving.
    Hugging Face's ``from_pretrained(dtype=...)`` keeps them fp32 the same way (no cast)."""

    def _apply(self, fn, recurse=True):
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            new = self._buffers[name]
            if new.dtype != buf.dtype:  # a cast: the new device, the old dtype
                self._buffers[name] = buf.to(device=new.device)
        return self


class DrafterAttention(nn.Module):
    lean = True  # training RoPE written into one tensor (apply_rope); False: transformers' expression

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, Hkv, T, D], k normed and rotated. With ``index`` [T'], x holds
        distinct rows and row t is x[:, index[t]]: projected and normed once, rotated per row."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if index is not None:
            k, v = k[:, index], v[:, index]
        return apply_rope(k.transpose(1, 2), cos, sin, _use_lean(self, x)), v.transpose(1, 2)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        if index is not None:
            q = q[:, index]
        return apply_rope(q.transpose(1, 2), cos, sin, _use_lean(self, x))

    def forward(self, x, rope, ctx_kv, mask=None, rows=None, index=None) -> torch.Tensor:
        """x [B, Q, H] block stream; ctx_kv: context k, v [B, Hkv, S, D].

        ``mask``: None (inference: every key visible), a bool [B, 1, Q, S + Q] mask, or a
        BlockAttentionPlan (training: dense / split / blockwise / flex, all the same function).
        ``rows``: a function of a [B, Q, ...] tensor returning the rows to output (None: all);
        every row still serves as a key. ``index`` [Q]: x holds the stream's distinct rows and
        row t is x[:, index[t]] (see keys_values).
        """
        cos, sin = rope
        q = self.queries(x, cos, sin, index)
        k_blk, v_blk = self.keys_values(x, cos, sin, index)
        plan = mask if isinstance(mask, BlockAttentionPlan) else BlockAttentionPlan("dense", mask=mask)
        if plan.impl == "blockwise":  # GQA without repeated heads (query heads stacked per KV head)
            out = blockwise_attention(q, k_blk, v_blk, ctx_kv[0], ctx_kv[1], plan)
            return self._project(out, rows)
        gqa = self.num_kv_heads != self.num_heads
        if gqa and x.device.type == "cpu":
            # The CPU SDPA kernel's enable_gqa backward is ~7x slower than plain MHA (torch
            # 2.13, measured): repeat the KV heads instead (same values, grads sum back).
            rep = self.num_heads // self.num_kv_heads
            ctx_kv = tuple(t.repeat_interleave(rep, dim=1) for t in ctx_kv)
            k_blk, v_blk = k_blk.repeat_interleave(rep, dim=1), v_blk.repeat_interleave(rep, dim=1)
            gqa = False
        if plan.impl == "split":
            out = split_attention(q, k_blk, v_blk, ctx_kv[0], ctx_kv[1], plan, gqa)
        else:
            k = torch.cat([ctx_kv[0], k_blk], dim=2)
            v = torch.cat([ctx_kv[1], v_blk], dim=2)
            if plan.impl == "flex":
                out = _flex_attention(q, k, v, plan.block_mask, gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, enable_gqa=gqa)
        return self._project(out, rows)

    def _project(self, out: torch.Tensor, rows=None) -> torch.Tensor:
        b = out.shape[0]
        out = out.transpose(1, 2)
        if rows is not None:
            out = rows(out)
        return self.o_proj(out.reshape(b, -1, self.num_heads * self.head_dim))


class _SwiGLU(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) saving only x, gate(x) and up(x): the [T, I] silu(gate) and
    product that autograd would also keep are recomputed in backward (elementwise, cheap).
    Both directions reuse their [T, I] temporaries in place: on CPU every fresh multi-MB tensor
    costs page faults (measured: ~10% of the step before this)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return F.linear(F.silu(gate).mul_(up), w_down)

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        shape = x.shape
        x, gate, up, dy = x.flatten(0, -2), gate.flatten(0, -2), up.flatten(0, -2), dy.flatten(0, -2)
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu(gate)
        tmp = act * up
        grad_down = dy.t() @ tmp
        d_prod = dy @ w_down
        d_up = torch.mul(d_prod, act, out=tmp)
        # silu'(g) = s (1 + g (1 - s)) = s (1 + g - silu(g)), written over act
        d_gate = d_prod.mul_(up).mul_(act.neg_().add_(gate).add_(1).mul_(sig))
        del act, sig
        dx = torch.addmm(d_gate @ w_gate, d_up, w_up)
        return dx.view(shape), d_gate.t() @ x, d_up.t() @ x, grad_down


class DrafterLayer(nn.Module):
    lean = True  # training MLP through _SwiGLU; False: Qwen3MLP under autograd

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.swiglu = config.hidden_act == "silu"  # Qwen3MLP: bias-free gate / up / down

    def forward(self, x, rope, ctx_kv, mask=None, rows=None, distinct=None) -> torch.Tensor:
        """``rows``: output only these rows of the block stream (DrafterAttention.forward).
        ``distinct``: (x's distinct rows [B, U, H], index [Q]) with x = distinct rows[:, index]:
        the input norm and the q / k / v projections run on the U distinct rows only."""
        if distinct is None:
            attn = self.self_attn(self.input_layernorm(x), rope, ctx_kv, mask, rows)
        else:
            attn = self.self_attn(self.input_layernorm(distinct[0]), rope, ctx_kv, mask, rows, distinct[1])
        x = (x if rows is None else rows(x)) + attn
        h = self.post_attention_layernorm(x)
        if self.swiglu and _use_lean(self, h):  # the memory-lean MLP (same values)
            mlp = self.mlp
            return x + _SwiGLU.apply(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        return x + self.mlp(h)


@dataclass
class ContextCache:
    """Per-layer context keys/values [B, Hkv, T, D] for decoding; holds CONTEXT rows only."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def crop(self, length: int) -> None:
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


# Config keys of newer DFlash checkpoints whose behaviour this drafter does not implement: a
# drafter loaded while ignoring them would draft unlike the one that was trained (wrong tau).
_UNSUPPORTED_KEYS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")


def _check_supported(config: dict, where) -> None:
    """Refuse, with the reason, a drafter config whose layers differ from the full-attention
    Qwen3 layers implemented here (sliding-window layers, scaled embeddings or outputs)."""
    kinds = set(config.get("layer_types") or ["full_attention"])
    problems = [f"layer_types {sorted(kinds)} (only full_attention layers are implemented)"] if kinds != {"full_attention"} else []
    if config.get("use_sliding_window") and config.get("sliding_window"):
        problems.append(f"use_sliding_window with sliding_window={config['sliding_window']}")
    problems += [f"{key}={config[key]!r}" for key in _UNSUPPORTED_KEYS if config.get(key) not in (None, 1, 1.0)]
    if problems:
        raise ValueError(f"{where}: this DFlash drafter uses {'; '.join(problems)}, which flashdraft does not "
                         "implement; evaluating or fine-tuning it here would give a different drafter")


class DFlashDrafter(nn.Module):
    """The DFlash drafter. ``config`` is the serving config.json dict."""

    def __init__(self, config: dict, *, attention: str = "auto", group_blocks: int = 0,
                 activation_checkpointing: bool = False, lean: bool = True):
        """``attention``: training-attention implementation (see resolve_attention);
        ``group_blocks``: blocks per group for "split" (0: auto, N / 8) and "blockwise" (0: auto,
        64 query rows);
        ``activation_checkpointing``: recompute each layer in backward (training forward only);
        ``lean``: the custom-backward RMSNorm / RoPE / SwiGLU in training without autocast (False:
        transformers' stock modules under autograd, same values: the oracle's way; see
        set_lean). Inference and autocast always run the stock modules.
        None of these touch the weights or the serving config."""
        super().__init__()
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={attention!r} unknown: use one of {', '.join(ATTENTION_IMPLS)}")
        self.attention = attention
        self.group_blocks = int(group_blocks)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.config = dict(config)
        qcfg = _qwen3_config(self.config)
        # newer exports may keep it only inside dflash_config
        self.block_size = int(self.config.get("block_size") or self.config["dflash_config"]["block_size"])
        self.mask_token_id = int(self.config["dflash_config"]["mask_token_id"])
        self.target_layer_ids = list(self.config["dflash_config"]["target_layer_ids"])
        hidden = qcfg.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(qcfg) for _ in range(qcfg.num_hidden_layers))
        self.norm = RMSNorm(hidden, eps=qcfg.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps=qcfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(qcfg)  # non-persistent fp32 buffers: never saved, never cast
        self.set_lean(lean)

    def set_lean(self, lean: bool) -> None:
        """Switch the training-time RMSNorm / RoPE / SwiGLU between the lean custom-backward
        versions and transformers' stock modules (same values; tests/test_step_equivalence.py)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, DrafterAttention, DrafterLayer)):
                module.lean = bool(lean)

    @classmethod
    def for_target(cls, target, *, num_layers: int, block_size: int, mask_token_id: int, **kwargs) -> "DFlashDrafter":
        """``kwargs``: the training-time switches of ``__init__`` (attention, group_blocks, ...)."""
        cfg = drafter_config_from_target(
            target.config, num_layers=num_layers, block_size=block_size,
            mask_token_id=mask_token_id, target_layer_ids=target.layer_ids,
        )
        return cls(cfg, **kwargs)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """The published recipe's init: normal(0, std) linears, ones for norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] for integer positions [B, T]."""
        return self.rotary_emb(like, positions)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Packed taps [B, S, K*H] -> context [B, S, H] (once per forward)."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys/values for fused context [B, S, H] at positions [B, S]."""
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        valid: torch.Tensor,
        attention: str | None = None,
        scored_only: bool = False,
        mask_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training forward over many anchored blocks of each sequence in one pass.

        features [B, S, K*H] target taps; block_embeds [B, N, bs, H] the target-embedded block
        tokens; anchors [B, N] positions, sorted ascending among the valid ones (sample_anchors
        does); valid [B, N] bool (padded blocks: False). ``attention`` overrides
        ``self.attention`` for this call ("dense" is the oracle). Returns norm(h) [B, N, bs, H],
        ready for the target's LM head. Equals, block by block, ``forward_block`` with
        context = features[:, :anchor] (tested), whatever the implementation.

        ``scored_only``: return slots 1..bs-1 only, [B, N, bs - 1, H]. Slot 0 (the anchor) is
        never scored, so the last layer skips its output projection, MLP and final norm (slot 0
        still serves as a key to the others): ~1/bs of the last layer and of the LM head saved.

        ``mask_embed`` [H]: the blocks are DFlash's [anchor token, MASK, ..., MASK]; then
        block_embeds is [B, N, H], the anchor tokens' embeddings only. Layer 0's input norm and
        q / k / v projections run on the N + 1 distinct rows (every MASK row is the same vector
        before RoPE) instead of N * bs: same result, ~(bs - 1) / bs of that work saved.

        Each layer's context K/V is computed once per sequence; a valid block anchored at a
        attends context j < a and its own bs slots, a padded block only its own slots.
        """
        b, s, _ = features.shape
        distinct = None
        if mask_embed is None:
            _, n, bs, hidden = block_embeds.shape
            x = block_embeds.reshape(b, n * bs, hidden)
        else:
            if block_embeds.dim() != 3:
                raise ValueError(f"with mask_embed, block_embeds holds the anchors' embeddings [B, N, H], not "
                                 f"{tuple(block_embeds.shape)}")
            (_, n, hidden), bs = block_embeds.shape, self.block_size
            distinct_rows = torch.cat([block_embeds, mask_embed.view(1, 1, hidden).expand(b, 1, hidden)], dim=1)
            index = torch.full((n, bs), n, device=anchors.device)  # row n: the MASK embedding
            index[:, 0] = torch.arange(n, device=anchors.device)
            index = index.flatten()
            distinct, x = (distinct_rows, index), distinct_rows[:, index]
        ctx = self.fuse(features)
        ctx_kv = self.context_kv(ctx, torch.arange(s, device=features.device).expand(b, s))
        positions = (anchors.unsqueeze(-1) + torch.arange(bs, device=anchors.device)).flatten(1)
        rope = self.rope(positions, x)
        plan = self.attention_plan(anchors, valid, s, attention, needs_grad=torch.is_grad_enabled(), dtype=x.dtype)
        last = len(self.layers) - 1

        def scored_rows(t: torch.Tensor) -> torch.Tensor:  # rows [B, N*bs, ...] -> slots 1.. [B, N*(bs-1), ...]
            return t.unflatten(1, (n, bs))[:, :, 1:].flatten(1, 2)

        # The last layer keeps its attention probabilities (blockwise): its backward comes first,
        # right after the head. The peak is at the start of the backward, so keeping them in
        # every layer would add every layer's probabilities to it, for the same saving per layer.
        last_plan = replace(plan, keep_probs=True)
        for i, (layer, kv) in enumerate(zip(self.layers, ctx_kv)):
            select = scored_rows if scored_only and i == last else None
            args = (x, rope, kv, last_plan if i == last else plan, select, distinct if i == 0 else None)
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        return self.norm(x).view(b, n, bs - int(scored_only), hidden)

    def attention_plan(
        self, anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, attention: str | None = None,
        needs_grad: bool = True, dtype: torch.dtype = torch.float32,
    ) -> BlockAttentionPlan:
        """The masks every layer of one training forward shares (see BlockAttentionPlan)."""
        impl = resolve_attention(attention or self.attention, anchors.device, needs_grad)
        bs = self.block_size
        if impl == "dense":
            return BlockAttentionPlan("dense", mask=dense_block_mask(anchors, valid, seq_len, bs))
        if impl == "flex":
            return BlockAttentionPlan("flex", block_mask=flex_block_mask(anchors, valid, seq_len, bs))
        n = anchors.shape[1]
        if impl == "blockwise":
            # Default: 64 query rows per group (4 blocks of 16), 4 groups per batched call.
            group = min(self.group_blocks if self.group_blocks > 0 else max(1, 64 // bs), n)
            groups = query_groups(anchors, valid, seq_len, bs, group, max(1, 256 // (group * bs)), dtype)
            return BlockAttentionPlan("blockwise", groups=groups, num_blocks=n)
        # Default: 8 groups. More groups cut the wasted g*bs block keys per query but repeat
        # the context K/V once per group (memory G * S * Hkv * D per layer); 8 measured best here.
        group = self.group_blocks if self.group_blocks > 0 else -(-n // 8)
        group = min(group, n)
        return BlockAttentionPlan(
            "split", mask=split_mask(anchors, valid, seq_len, bs, group),
            group_blocks=group, num_groups=-(-n // group), num_blocks=n,
        )

    # ---- decoding -------------------------------------------------------------------------

    def new_cache(self) -> ContextCache:
        return ContextCache([], [])

    def extend_context(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Append context rows (taps [B, T, K*H] of the next T positions) to the cache."""
        b, t, _ = features.shape
        start = cache.length
        positions = torch.arange(start, start + t, device=features.device).expand(b, t)
        kvs = self.context_kv(self.fuse(features), positions)
        if not cache.keys:
            cache.keys = [k for k, _ in kvs]
            cache.values = [v for _, v in kvs]
        else:
            cache.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(cache.keys, kvs)]
            cache.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(cache.values, kvs)]

    def forward_block(self, cache: ContextCache, block_embeds: torch.Tensor) -> torch.Tensor:
        """Inference forward of one block [B, bs, H] placed right after the cached context.

        The block sees every cached context row and itself (bidirectionally); its own rows are
        never added to the cache (the crop back to ``start`` of DFLASH.md is implicit).
        """
        b, t, _ = block_embeds.shape
        start = cache.length
        positions = torch.arange(start, start + t, device=block_embeds.device).expand(b, t)
        rope = self.rope(positions, block_embeds)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, (cache.keys[i], cache.values[i]))
        return self.norm(x)

    # ---- serving format -------------------------------------------------------------------

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write config.json + model.safetensors (no embedding, no LM head, no rotary buffers).
        Each file is written beside its final name and renamed onto it: a crash mid-export leaves
        the previous export's file, never a torn one."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        config = dict(self.config, dtype=str(dtype).removeprefix("torch."))
        tmp = {name: path / f".{name}.tmp-{os.getpid()}" for name in ("model.safetensors", "config.json")}
        try:
            save_file(state, tmp["model.safetensors"], metadata={"format": "pt"})
            tmp["config.json"].write_text(json.dumps(config, indent=2) + "\n")
            for name, written in tmp.items():
                os.replace(written, path / name)
        finally:
            for written in tmp.values():
                written.unlink(missing_ok=True)
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu") -> "DFlashDrafter":
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        if "DFlashDraftModel" not in config.get("architectures", []):
            raise ValueError(f"{path}/config.json: not a DFlash drafter (architectures={config.get('architectures')})")
        _check_supported(config, path / "config.json")
        model = cls(config)
        state = load_file(path / "model.safetensors")
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}/model.safetensors: missing weights {missing}, unexpected weights {unexpected}")
        return model.to(device=device, dtype=dtype)
