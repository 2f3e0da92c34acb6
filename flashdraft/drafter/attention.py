"""The drafter's training attention: which implementation runs, and all of them.

Block queries [B, Hq, Q, D] (Q = N blocks * bs slots) attend [context | block slots]: a valid
block anchored at a sees context positions j < a and its own bs slots, a padded block only its
own slots. Four implementations compute that same function (tests/test_step_equivalence.py):
"dense" (the oracle: one SDPA under a full bool mask), "split" (groups of blocks folded into the
batch, one SDPA), "blockwise" (groups over their context prefix, matmuls, a custom autograd
Function) and "flex" (flex_attention under a block-sparse BlockMask, compiled on CUDA).
``resolve_attention`` picks one, ``attention_plan`` builds the masks every layer of one forward
shares (a BlockAttentionPlan), and ``attend`` runs a layer's attention under that plan.

The choice lists (``ATTENTION_IMPLS``, ``SINK_IMPLS``) and each layer's pattern (``LayerMask``)
are the config's vocabulary, declared in ``flashdraft.config``; every implementation they name is here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from flashdraft.autocast import autocast_suspended
from flashdraft.config import ATTENTION_IMPLS, SINK_IMPLS, LayerMask


def resolve_attention(impl: str, device: torch.device, needs_grad: bool, sinks: bool = False) -> str:
    """Pick the concrete training-attention implementation for ``impl`` on ``device``.

    "auto": "flex" on CUDA when flex_attention imports (block-sparse, fused, one kernel per
    layer), else "blockwise" (groups of blocks over their context prefix, matmuls); with
    attention ``sinks``, "blockwise" (flex has no sink; blockwise works in fp32 under autocast).
    "flex" asked for where it cannot run backward (CPU with grad) falls back to "blockwise":
    flex_attention has no CPU backward. "flex" with ``sinks`` is refused (ValueError).
    """
    if impl in EXTRA_IMPLS:
        return impl
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {impl!r} unknown: use one of {', '.join(ATTENTION_IMPLS)}")
    if sinks and impl not in SINK_IMPLS:
        raise ValueError(f"drafter.attention={impl} has no attention sink (drafter.attention_sink=true): "
                         f"use one of {', '.join(SINK_IMPLS)} (auto trains sinks blockwise on CUDA)")
    if impl in ("auto", "flex"):
        if device.type == "cuda" and _flex_available() and not sinks:
            return "flex"
        if impl == "flex" and not needs_grad:
            return "flex"  # forward-only flex runs (unfused) on CPU: used by the tests
        return "blockwise"
    return impl


# Named implementations besides ATTENTION_IMPLS, which no config can pick: name -> (plan builder
# (anchors, valid, seq_len, block_size, dtype) -> BlockAttentionPlan, kernel with attend's
# arguments). The memory plan's stand-ins register here (drafter/stand_in.py).
EXTRA_IMPLS: dict[str, tuple[Callable, Callable]] = {}


def register_attention(name: str, plan: Callable, kernel: Callable) -> None:
    if name in ATTENTION_IMPLS:
        raise ValueError(f"attention {name!r} is a built-in implementation")
    EXTRA_IMPLS[name] = (plan, kernel)


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


FULL = LayerMask()


def _slots_visible(q_slot: torch.Tensor, k_slot: torch.Tensor, layer: LayerMask) -> torch.Tensor:
    """In-block visibility of slot k_slot to slot q_slot (broadcast) under ``layer``."""
    ok = torch.ones(torch.broadcast_shapes(q_slot.shape, k_slot.shape), dtype=torch.bool, device=q_slot.device)
    if layer.causal:
        ok = ok & (k_slot <= q_slot)
    if layer.window is not None:
        ok = ok & (q_slot - k_slot < layer.window)
    return ok


def _in_block_visible(rows: int, block_size: int, layer: LayerMask, device) -> torch.Tensor:
    """[rows, rows] bool: key row j visible to query row i, rows being consecutive whole blocks
    of ``block_size`` slots -- the same block, as ``layer`` allows its slots."""
    block_id = torch.arange(rows, device=device) // block_size
    slot = torch.arange(rows, device=device) % block_size
    return (block_id.view(-1, 1) == block_id.view(1, -1)) & _slots_visible(slot.view(-1, 1), slot.view(1, -1), layer)


def _context_visible(ctx_pos: torch.Tensor, limit: torch.Tensor, query_pos: torch.Tensor,
                     layer: LayerMask) -> torch.Tensor:
    """Context visibility (broadcast): position ctx_pos < ``limit`` (the anchor; 0 for a padded
    block), and within the window of the query's own position ``query_pos``."""
    ok = ctx_pos < limit
    if layer.window is not None:
        ok = ok & (query_pos - ctx_pos < layer.window)
    return ok


def dense_block_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int,
                     layer: LayerMask = FULL) -> torch.Tensor:
    """Bool attention mask [B, 1, Q, S + Q] over [context | all blocks] (Q = N * bs).

    A valid block anchored at a sees context positions j < a and its own bs slots, as ``layer``
    allows (window, in-block causality). A padded (invalid) block sees only its own slots (so
    its softmax stays finite; it has zero weight). Every row sees its own slot.
    """
    b, n = anchors.shape
    q = n * block_size
    ctx_pos = torch.arange(seq_len, device=anchors.device)
    slot = torch.arange(block_size, device=anchors.device)
    limit = torch.where(valid, anchors, torch.zeros_like(anchors))  # invalid blocks: no context
    query_pos = anchors.view(b, n, 1, 1) + slot.view(1, 1, -1, 1)  # [B, N, bs, 1]
    sees_ctx = _context_visible(ctx_pos.view(1, 1, 1, -1), limit.view(b, n, 1, 1), query_pos, layer)
    sees_ctx = sees_ctx.expand(b, n, block_size, seq_len).reshape(b, q, seq_len)
    same_block = _in_block_visible(q, block_size, layer, anchors.device)
    return torch.cat([sees_ctx, same_block.expand(b, q, q)], dim=-1).unsqueeze(1)


def decode_mask(context: int, block_size: int, layer: LayerMask, device) -> torch.Tensor | None:
    """Bool mask [1, 1, bs, context + bs] of one block decoded right after ``context`` rows
    (inference: the training mask of one block anchored at ``context``); None when every key is
    visible (a full, bidirectional layer)."""
    if layer == FULL:
        return None
    return dense_block_mask(torch.tensor([[context]], device=device), torch.tensor([[True]], device=device), context,
                            block_size, layer)


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
    groups: list[QueryGroup] = field(default_factory=list)


def split_mask(
    anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int, group_blocks: int,
    layer: LayerMask = FULL,
) -> torch.Tensor:
    """Bool mask [B * G, 1, g*bs, S + g*bs] of the "split" attention (G = ceil(N / g) groups).

    Row r of group gi is slot r % bs of block gi*g + r // bs: it sees context j < anchor (none
    for padded blocks and for the pad blocks added to fill the last group) and the slots of its
    own block, as ``layer`` allows. Every row sees at least its own slot, so no softmax row is
    empty.
    """
    b, n = anchors.shape
    num_groups = -(-n // group_blocks)
    fill = num_groups * group_blocks - n
    limit = F.pad(torch.where(valid, anchors, torch.zeros_like(anchors)).clamp(max=seq_len), (0, fill))  # [B, G*g]
    gq = group_blocks * block_size

    def rows(t):  # [B, G*g] per block -> [B*G, gq, 1] per row
        return t.view(b * num_groups, group_blocks, 1).expand(-1, -1, block_size).reshape(-1, gq, 1)

    q_slot = torch.arange(gq, device=anchors.device) % block_size
    query_pos = rows(F.pad(anchors, (0, fill))) + q_slot.view(1, -1, 1)
    sees_ctx = _context_visible(torch.arange(seq_len, device=anchors.device).view(1, 1, -1), rows(limit), query_pos,
                                layer)  # [B*G, gq, S]
    same_block = _in_block_visible(gq, block_size, layer, anchors.device)
    return torch.cat([sees_ctx, same_block.expand(b * num_groups, gq, gq)], dim=-1).unsqueeze(1)


def split_attention(q, k_blk, v_blk, k_ctx, v_ctx, plan: BlockAttentionPlan, enable_gqa: bool,
                    sink: torch.Tensor | None = None) -> torch.Tensor:
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

    out = _sdpa(grouped(q).reshape(b * g, hq, gq, d), keys(k_ctx, k_blk), keys(v_ctx, v_blk), plan.mask,
                enable_gqa, sink)
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
    context_start: int = 0  # the context keys are positions context_start .. context - 1 (a window's cut)


def query_groups(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int, group_blocks: int,
                 groups_per_call: int = 1, dtype: torch.dtype = torch.float32,
                 layer: LayerMask = FULL) -> list[QueryGroup]:
    """The "blockwise" plan: groups of ``group_blocks`` consecutive blocks, ``groups_per_call`` of
    them per batched call, context cut at the call's largest anchor over the batch (one host
    sync, for the key lengths) and, under a window, started at the call's earliest key any of
    its queries sees. Exact whatever the anchor order; cheapest with sorted anchors
    (sample_anchors sorts them). Small groups waste fewer block keys; several per call keep
    the number of (CPU-thread-synchronising) ops per layer low."""
    b, n = anchors.shape
    limit = torch.where(valid, anchors, torch.zeros_like(anchors)).clamp(max=seq_len)  # padded blocks: no context
    spans, first = [], 0  # (first block, groups, blocks per group)
    while first < n:
        k = min(groups_per_call, (n - first) // group_blocks)
        spans.append((first, k, group_blocks) if k else (first, 1, n - first))
        first += spans[-1][1] * spans[-1][2]
    bounds = [limit[:, i:i + k * g].amax() for i, k, g in spans]
    if layer.window is not None:  # a slot-0 query sees back to anchor - (window - 1): the call's earliest key
        lowest = torch.where(valid, anchors - (layer.window - 1), torch.full_like(anchors, seq_len)).clamp(min=0)
        bounds += [lowest[:, i:i + k * g].amin() for i, k, g in spans]
    bounds = torch.stack(bounds).tolist()
    lengths = bounds[:len(spans)]
    starts = [min(lo, hi) for lo, hi in zip(bounds[len(spans):], lengths)] if layer.window is not None else \
        [0] * len(spans)
    calls = []
    slot = torch.arange(block_size, device=anchors.device)
    for (i, k, g), length, begin in zip(spans, lengths, starts):
        rows = g * block_size
        row_limit = limit[:, i:i + k * g].view(b, k, g).repeat_interleave(block_size, dim=2).unsqueeze(-1)
        query_pos = (anchors[:, i:i + k * g].view(b, k, g, 1) + slot).view(b, k, rows, 1)
        sees_ctx = _context_visible(torch.arange(begin, length, device=anchors.device), row_limit, query_pos,
                                    layer)  # [B, k, rows, L - begin]
        same_block = _in_block_visible(rows, block_size, layer, anchors.device)
        bias = torch.cat([torch.where(sees, 0.0, float("-inf")) for sees in (sees_ctx,
                                                                            same_block.expand(b, k, rows, rows))], -1)
        calls.append(QueryGroup(i * block_size, (i + k * g) * block_size, length, k,
                                bias.to(dtype).view(b, 1, k, 1, rows, -1), begin))
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
    prefix = ctx[:, :, None, g.context_start:g.context].expand(b, hkv, g.groups, g.context - g.context_start, d)
    return torch.cat([prefix, _to_groups(blk, g, hkv)], dim=3)


def _group_probs(qg: torch.Tensor, kg: torch.Tensor, g: QueryGroup, sink: torch.Tensor | None = None):
    """Attention probabilities [B, Hkv, groups, rep * rows, context + rows] (qg pre-scaled).
    ``sink`` [1, Hkv, 1, rep * rows, 1]: each row's sink logit, a column in the softmax that is
    then dropped; then (probabilities, the sink's share [B, Hkv, groups, rep * rows, 1] in fp32,
    exp(s_h - LSE): 1 minus a bf16 row sum would be mostly rounding at a realistic context)."""
    s = qg @ kg.transpose(-1, -2)
    b, hkv, k, _, keys = s.shape
    s.view(b, hkv, k, -1, g.bias.shape[-2], keys).add_(g.bias)
    if sink is None:
        return torch.softmax(s, dim=-1)
    top = torch.maximum(s.amax(-1, keepdim=True), sink).float()
    lse = (s.float() - top).exp().sum(-1, keepdim=True).add_((sink.float() - top).exp()).log_().add_(top)
    return s.sub_(lse.to(s.dtype)).exp_(), (sink.float() - lse).exp()


def _sink_rows(sink: torch.Tensor | None, heads: int, kv_heads: int, rows: int) -> torch.Tensor | None:
    """Per-head sink logits [H] laid out as the grouped rows of _to_groups: [1, Hkv, 1, rep * rows, 1]."""
    if sink is None:
        return None
    rep = heads // kv_heads
    return sink.view(kv_heads, rep, 1).expand(kv_heads, rep, rows).reshape(1, kv_heads, 1, rep * rows, 1)


class _BlockwiseAttention(torch.autograd.Function):
    """Softmax attention of each group over its own keys, calls of groups one after another.

    Saved: q, k, v and the output, plus each call's probabilities with ``keep_probs`` (else the
    backward recomputes them per call); no score matrix of another call, no per-group K/V copy
    outlives its loop iteration, no repeated KV heads. Every query row sees its own slots, so
    no row is empty. bf16 / fp16 inputs are worked on in fp32 one call at a time (_work_dtype):
    the outputs and gradients come back in the inputs' dtype.
    """

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, calls, keep_probs, sink=None):
        hkv, work = k_ctx.shape[1], _work_dtype(q.dtype)
        out, q_scaled = torch.empty_like(q), q * q.shape[-1] ** -0.5
        probs = []
        for g in calls:
            rows = _sink_rows(sink, q.shape[1], hkv, (g.stop - g.start) // g.groups)
            p = _group_probs(_to_groups(q_scaled, g, hkv).to(work), _group_kv(k_ctx, k_blk, g).to(work), g,
                             None if rows is None else rows.to(work))
            if sink is not None:
                p, p_sink = p
            _from_groups(p @ _group_kv(v_ctx, v_blk, g).to(work), out, g)
            if keep_probs:  # kept in the inputs' dtype (memory); the backward works in ``work`` again
                probs += [p.to(q.dtype), p_sink] if sink is not None else [p.to(q.dtype)]
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, out, *((sink,) if sink is not None else ()), *probs)
        ctx.calls, ctx.has_sink = calls, sink is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_ctx, v_ctx, k_blk, v_blk, out, *rest = ctx.saved_tensors
        sink, probs = (rest[0], rest[1:]) if ctx.has_sink else (None, rest)
        hkv, work = k_ctx.shape[1], _work_dtype(q.dtype)
        scale = q.shape[-1] ** -0.5
        dq, dk_blk, dv_blk = torch.empty_like(q), torch.empty_like(k_blk), torch.empty_like(v_blk)
        # the context's gradients sum over every group that sees it: accumulated in ``work``
        dk_ctx, dv_ctx = (torch.zeros(t.shape, dtype=work, device=t.device) for t in (k_ctx, v_ctx))
        # sum_j p_j dp_j per query row; with a sink, p the sink-normalised probabilities: the same
        # formulas hold (the sink has no value), and d sink = -sum over its rows of p_sink * delta
        delta = (dout.to(work) * out.to(work)).sum(-1, keepdim=True)
        dsink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device) if sink is not None else None
        q_scaled = q * scale
        per_call = 2 if sink is not None else 1  # saved per call: its probabilities (and sink shares)
        for i, g in enumerate(ctx.calls):
            qg, kg, vg = (t.to(work) for t in (_to_groups(q_scaled, g, hkv), _group_kv(k_ctx, k_blk, g),
                                               _group_kv(v_ctx, v_blk, g)))
            rows = _sink_rows(sink, q.shape[1], hkv, (g.stop - g.start) // g.groups)
            found = probs[per_call * i:per_call * (i + 1)] if probs else \
                _group_probs(qg, kg, g, None if rows is None else rows.to(work))
            p, p_sink = (found if sink is not None else (found[0] if probs else found, None))
            p = p.to(work)
            do = _to_groups(dout, g, hkv).to(work)
            if dsink is not None:  # d s_h = -sum over its rows of p_sink * delta (fp32); -> [H]
                term = p_sink.squeeze(-1).float() * _to_groups(delta, g, hkv).squeeze(-1).float()
                dsink -= term.sum((0, 2)).view(hkv, -1, (g.stop - g.start) // g.groups).sum(-1).flatten()
            ds = (do @ vg.transpose(-1, -2)).sub_(_to_groups(delta, g, hkv)).mul_(p)
            dv = p.transpose(-1, -2) @ do
            dk = ds.transpose(-1, -2) @ qg
            _from_groups((ds @ kg).mul_(scale), dq, g)
            lo, n = g.context_start, g.context - g.context_start  # the group's context keys
            dk_ctx[:, :, lo:g.context] += dk[:, :, :, :n].sum(2)
            dv_ctx[:, :, lo:g.context] += dv[:, :, :, :n].sum(2)
            _from_groups(dk[:, :, :, n:], dk_blk, g)
            _from_groups(dv[:, :, :, n:], dv_blk, g)
        return (dq, dk_ctx.to(k_ctx.dtype), dv_ctx.to(v_ctx.dtype), dk_blk, dv_blk, None, None,
                None if dsink is None else dsink.to(sink.dtype))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The blockwise attention's working precision for inputs of ``dtype``: fp32 for bf16 / fp16
    (scores, softmax, delta and ds as a fused kernel keeps them: in bf16 they cost 2-6x the
    gradient error, tests/test_sinks.py), the inputs' own dtype otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def blockwise_attention(q, k_blk, v_blk, k_ctx, v_ctx, plan: BlockAttentionPlan,
                        sink: torch.Tensor | None = None) -> torch.Tensor:
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
        if sink is not None:
            sink = sink.to(tensors[0].dtype)
        keep = plan.keep_probs and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return _BlockwiseAttention.apply(*tensors, calls, keep, sink)


def flex_mask_mod(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int, layer: LayerMask = FULL):
    """flex_attention's mask_mod over keys [context S | all N*bs slots]: dense_block_mask's pattern
    for one (batch, head, query, key) index."""
    limit = torch.where(valid, anchors, torch.zeros_like(anchors))
    window, causal = layer.window, layer.causal

    def mask_mod(bi, hi, q_idx, kv_idx):
        blk, q_slot = q_idx // block_size, q_idx % block_size
        sees_ctx = kv_idx < limit[bi, blk]  # limit <= S, so this is inside the context part
        k_slot = (kv_idx - seq_len) % block_size
        own = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == blk)
        if window is not None:
            sees_ctx = sees_ctx & (anchors[bi, blk] + q_slot - kv_idx < window)
            own = own & (q_slot - k_slot < window)
        if causal:
            own = own & (k_slot <= q_slot)
        return sees_ctx | own

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int,
                    layer: LayerMask = FULL, tile: int = 128):
    """flex_attention BlockMask over keys [context S | all N*bs slots], dense_block_mask's pattern,
    built from the anchors without the dense [B, Q, S + Q] grid (create_block_mask evaluates the
    mask_mod at every element: ~10 bytes each, GiBs at real sizes). Memory ~ B * Q * 16 bytes.

    Every query row sees two intervals of keys: the context [lo, hi) (hi its block's anchor, 0
    for a padded block; lo the window's start) and its own block's slots (from the window's
    start to the block's end, or to itself when causal). A tile of ``tile`` queries x ``tile``
    keys is visited when some row's interval meets it and full (no mask_mod) when every row's
    interval covers it; both counted per tile with difference arrays over the key tiles. Equal
    to create_block_mask of flex_mask_mod (tests/test_block_mask.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    b, n = anchors.shape
    q_len, kv_len, device = n * block_size, seq_len + n * block_size, anchors.device
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    row = torch.arange(q_len, device=device)
    blk, slot = row // block_size, row % block_size  # [Q]
    anchor = anchors.long()[:, blk]  # [B, Q]
    ctx_hi = torch.where(valid[:, blk], anchor, 0).clamp(0, seq_len)
    ctx_lo = torch.zeros_like(ctx_hi) if layer.window is None else (anchor + slot - layer.window + 1).clamp(min=0)
    own_lo = seq_len + blk * block_size + (0 if layer.window is None else (slot - layer.window + 1).clamp(min=0))
    own_hi = seq_len + blk * block_size + (slot + 1 if layer.causal else block_size)
    intervals = [(ctx_lo, ctx_hi), (own_lo.expand(b, -1), own_hi.expand(b, -1))]

    def per_tile(touched: bool) -> torch.Tensor:
        """[B, q_tiles, kv_tiles]: how many rows of each query tile meet (``touched``) or cover
        each key tile, from each row's tile range [first, last] of each interval."""
        diff = torch.zeros(b, q_tiles, kv_tiles + 1, dtype=torch.int32, device=device)
        for lo, hi in intervals:
            first, last = (lo // tile, (hi - 1) // tile) if touched else (-(-lo // tile), hi // tile - 1)
            keep = ((hi > lo) & (first <= last)).int()
            at = (torch.arange(b, device=device).view(-1, 1) * q_tiles + row // tile) * (kv_tiles + 1)
            diff.view(-1).scatter_add_(0, (at + first).flatten(), keep.flatten())
            diff.view(-1).scatter_add_(0, (at + (last + 1).clamp(max=kv_tiles)).flatten(), -keep.flatten())
        return diff.cumsum(-1)[..., :kv_tiles]

    full = per_tile(touched=False) == tile  # every one of the tile's rows covers it (a tile covered only by
    # the two intervals together, which needs block_size >= tile, is visited as partial: exact all the same)
    partial = (per_tile(touched=True) > 0) & ~full

    def ordered(tiles: torch.Tensor):  # the visited key tiles first, ascending (create_block_mask's order)
        tiles = tiles.unsqueeze(1).int()  # [B, 1 (every head), q_tiles, kv_tiles]
        return tiles.sum(-1).int(), tiles.argsort(dim=-1, descending=True, stable=True).int()

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=tile,
                                    mask_mod=flex_mask_mod(anchors, valid, seq_len, block_size, layer),
                                    seq_lengths=(q_len, kv_len))


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

    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    setattr(dynamo, name, max(getattr(dynamo, name), FLEX_RECOMPILE_LIMIT))
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
                "Set drafter.attention=blockwise to train with the exact matmul attention instead "
                "(slower, more memory), and report the error"
            ) from exc


def attention_plan(
    impl: str, anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int, group_blocks: int = 0,
    needs_grad: bool = True, dtype: torch.dtype = torch.float32, layer: LayerMask = FULL,
) -> BlockAttentionPlan:
    """The masks the layers of one training forward with the same ``layer`` pattern share (see
    BlockAttentionPlan), for blocks of ``block_size`` slots anchored at ``anchors`` [B, N]
    (``valid`` [B, N]) over ``seq_len`` context positions. ``impl``: one of ATTENTION_IMPLS,
    resolved on the anchors' device (resolve_attention); ``group_blocks``: blocks per group for
    "split" and "blockwise" (0: auto); ``dtype``: the blockwise bias dtype (the queries')."""
    impl = resolve_attention(impl, anchors.device, needs_grad)
    if impl in EXTRA_IMPLS:
        return EXTRA_IMPLS[impl][0](anchors, valid, seq_len, block_size, dtype)
    bs = block_size
    if impl == "dense":
        return BlockAttentionPlan("dense", mask=dense_block_mask(anchors, valid, seq_len, bs, layer))
    if impl == "flex":
        return BlockAttentionPlan("flex", block_mask=flex_block_mask(anchors, valid, seq_len, bs, layer))
    n = anchors.shape[1]
    if impl == "blockwise":
        # Default: 64 query rows per group (4 blocks of 16), 4 groups per batched call.
        group = min(group_blocks if group_blocks > 0 else max(1, 64 // bs), n)
        groups = query_groups(anchors, valid, seq_len, bs, group, max(1, 256 // (group * bs)), dtype, layer)
        return BlockAttentionPlan("blockwise", groups=groups, num_blocks=n)
    # Default: 8 groups. More groups cut the wasted g*bs block keys per query but repeat
    # the context K/V once per group (memory G * S * Hkv * D per layer); 8 measured best here.
    group = group_blocks if group_blocks > 0 else -(-n // 8)
    group = min(group, n)
    return BlockAttentionPlan(
        "split", mask=split_mask(anchors, valid, seq_len, bs, group, layer),
        group_blocks=group, num_groups=-(-n // group), num_blocks=n,
    )


def attend(q, k_blk, v_blk, k_ctx, v_ctx, plan: BlockAttentionPlan, sink: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention of the block queries q [B, Hq, Q, D] over [context k / v [B, Hkv, S, D]
    | block k / v [B, Hkv, Q, D]] as ``plan`` says -> [B, Hq, Q, D]. A "dense" plan whose ``mask``
    is None lets every query see every key (inference: one block after its whole context).
    Hq may be a multiple of Hkv (GQA). ``sink`` [Hq]: an attention sink's per-head logit s_h,
    one more column in every row's softmax, visible to every query, with no value (DFLASH2.md
    3.1: exp(z_j) / (exp(s_h) + sum_i exp(z_i))); flex has none (resolve_attention refuses it)."""
    if plan.impl in EXTRA_IMPLS:
        return EXTRA_IMPLS[plan.impl][1](q, k_blk, v_blk, k_ctx, v_ctx, plan, sink)
    if plan.impl == "blockwise":  # GQA without repeated heads (query heads stacked per KV head)
        return blockwise_attention(q, k_blk, v_blk, k_ctx, v_ctx, plan, sink)
    heads, kv_heads = q.shape[1], k_blk.shape[1]
    gqa = kv_heads != heads
    if gqa and q.device.type == "cpu":
        # The CPU SDPA kernel's enable_gqa backward is ~7x slower than plain MHA (torch
        # 2.13, measured): repeat the KV heads instead (same values, grads sum back).
        rep = heads // kv_heads
        k_ctx, v_ctx = k_ctx.repeat_interleave(rep, dim=1), v_ctx.repeat_interleave(rep, dim=1)
        k_blk, v_blk = k_blk.repeat_interleave(rep, dim=1), v_blk.repeat_interleave(rep, dim=1)
        gqa = False
    if plan.impl == "split":
        return split_attention(q, k_blk, v_blk, k_ctx, v_ctx, plan, gqa, sink)
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    if plan.impl == "flex":
        if sink is not None:
            raise ValueError(f"attention sinks run on {', '.join(SINK_IMPLS[1:])}, not flex (see resolve_attention)")
        return _flex_attention(q, k, v, plan.block_mask, gqa)
    return _sdpa(q, k, v, plan.mask, gqa, sink)


def _sdpa(q, k, v, mask, enable_gqa: bool, sink: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, Hq, Q, D] over k / v [B, Hkv, K, D] under the bool ``mask`` (None: all
    visible). ``sink`` [Hq]: one more key that every query sees, scored s_h and valued 0 -- q
    carries s_h * sqrt(D) in an extra dimension that only the sink key has (1 there, 0 for the
    others), so the other scores and the scale stay as they are. The extra dimensions come in
    8s (the sink's and 7 zeros), v's too, so that the fused kernels' head-size rules still hold."""
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    extra = F.pad((sink.to(q.dtype) * d**0.5).view(1, hq, 1, 1).expand(b, hq, n, 1), (0, _PAD - 1))
    q = torch.cat([q, extra], dim=-1)
    sink_key = F.pad(k.new_ones(b, hkv, 1, 1), (d, _PAD - 1))
    k = torch.cat([F.pad(k, (0, _PAD)), sink_key], dim=2)
    v = torch.cat([F.pad(v, (0, _PAD)), v.new_zeros(b, hkv, 1, d + _PAD)], dim=2)
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa, scale=d**-0.5)
    return out[..., :d]


_PAD = 8  # extra head dimensions of _sdpa's sink
