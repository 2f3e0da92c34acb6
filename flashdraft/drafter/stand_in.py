"""The memory plan's stand-in attention: named implementations that allocate what the real
kernels keep, without computing anything (flashdraft.train.plan runs the drafter's step on fake
tensors, whose values -- and so the anchors a real mask is built from -- do not exist).

Registered with drafter.attention under ``stand_in_name(impl)``; a drafter built with that
``attention`` runs its real layers, head and loss around them. Nothing is patched: the names
are not in ``ATTENTION_IMPLS``, so no user config can pick them.

- ``stand-in:flex`` saves for backward what flex_attention saves: q, the [context | blocks] keys
  and values (GQA without repeated heads), the output and the fp32 log-sum-exp.
- ``stand-in:blockwise`` (every other implementation is planned as blockwise, the CPU and sink
  path): q, k, v, the output, the plan's additive masks [B, rows, keys] per batched call (alive
  for the whole forward + backward) and, with ``keep_probs``, the last layer's probabilities.
"""

from __future__ import annotations

import math

import torch

from flashdraft.drafter.attention import BlockAttentionPlan, register_attention

STAND_IN = "stand-in:"


def stand_in_name(impl: str) -> str:
    """The stand-in that models the resolved implementation ``impl``."""
    return STAND_IN + ("flex" if impl == "flex" else "blockwise")


class _SavedLike(torch.autograd.Function):
    """Returns a tensor shaped like q and saves ``saved`` for backward (what the real kernel
    keeps); its backward returns gradients of the inputs' shapes (no values)."""

    @staticmethod
    def forward(ctx, q, k1, v1, k2, v2, *saved):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k1, v1, k2, v2, out, *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k1, v1, k2, v2, _, *rest = ctx.saved_tensors  # read once (activation checkpointing allows no more)
        return (torch.empty_like(q), torch.empty_like(k1), torch.empty_like(v1), torch.empty_like(k2),
                torch.empty_like(v2), *([None] * len(rest)))


def blockwise_calls(b: int, n: int, seq_len: int, bs: int) -> list[tuple[int, int]]:
    """(query rows, keys) of each batched call of the blockwise plan (attention.query_groups):
    groups of 64 // bs blocks, 256 query rows per call; a call's context is its last anchor
    (anchors sorted, spread evenly over the sequence: the expected order statistic)."""
    group = min(max(1, 64 // bs), n)
    per_call = max(1, 256 // (group * bs))
    out, first = [], 0
    while first < n:
        k = min(per_call, (n - first) // group)
        blocks, g = (k * group, group) if k else (n - first, n - first)
        first += blocks
        context = min(seq_len, math.ceil(first * seq_len / n))
        out.append((blocks * bs, context + g * bs))
    return out


def _flex_plan(anchors, valid, seq_len, block_size, dtype) -> BlockAttentionPlan:
    return BlockAttentionPlan(STAND_IN + "flex", num_blocks=anchors.shape[1])


def _flex(q, k_blk, v_blk, k_ctx, v_ctx, plan, sink=None):
    k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return _SavedLike.apply(q, k, v, k[..., :0, :], v[..., :0, :], lse)


def _blockwise_plan(anchors, valid, seq_len, block_size, dtype) -> BlockAttentionPlan:
    b, n = anchors.shape
    calls = blockwise_calls(b, n, seq_len, block_size)
    bias = anchors.new_empty(sum(b * r * k for r, k in calls), dtype=dtype)
    return BlockAttentionPlan(STAND_IN + "blockwise", num_blocks=n, groups=[(calls, bias)])


def _blockwise(q, k_blk, v_blk, k_ctx, v_ctx, plan, sink=None):
    calls, bias = plan.groups[0]
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
    tensors = [t.to(dtype) for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    saved = [bias]
    if plan.keep_probs and torch.is_grad_enabled():  # the last layer's probabilities, per call
        saved.append(q.new_empty(sum(q.shape[0] * q.shape[1] * r * k for r, k in calls), dtype=dtype))
    with torch.autocast(q.device.type, enabled=False):
        return _SavedLike.apply(*tensors, *saved)


register_attention(STAND_IN + "flex", _flex_plan, _flex)
register_attention(STAND_IN + "blockwise", _blockwise_plan, _blockwise)
