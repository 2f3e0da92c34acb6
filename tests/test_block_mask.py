"""The flex BlockMask built from the anchors (attention.flex_block_mask, issue 28.4): equal to
create_block_mask of the same mask_mod (which evaluates it at every one of B x Q x KV elements)
for random anchors, windows, causality and block sizes; flex_attention under it equal to the dense
oracle; and its memory bounded where the dense grid would take gigabytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex  # torch 2.13 (pinned) has it: its absence is a failure

from flashdraft.bench.gpu_check import LiveTensorBytes
from flashdraft.config import LayerMask
from flashdraft.drafter.attention import attend, attention_plan, flex_block_mask, flex_mask_mod


def _case(g: torch.Generator, trial: int):
    b, s, n = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (5, 400), (1, 40)))
    bs = (2, 3, 4, 16, 5)[trial % 5]
    anchors = torch.randint(0, s, (b, n), generator=g)
    if trial % 2:  # sample_anchors sorts them; the mask must not need it
        anchors = anchors.sort(-1).values
    valid = torch.rand(b, n, generator=g) < 0.8
    layer = LayerMask((None, 3, 100, 200)[trial % 4], trial % 3 == 0)
    return anchors, valid, s, bs, layer


@pytest.mark.parametrize("tile", [128, 32])
def test_the_anchor_built_mask_equals_create_block_mask(tile):
    g = torch.Generator().manual_seed(tile)
    for trial in range(40):
        anchors, valid, s, bs, layer = _case(g, trial)
        b, n = anchors.shape
        got = flex_block_mask(anchors, valid, s, bs, layer, tile=tile)
        ref = flex.create_block_mask(flex_mask_mod(anchors, valid, s, bs, layer), b, None, n * bs, s + n * bs,
                                     device="cpu", BLOCK_SIZE=tile)
        for name, x, y in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"),
                              got.as_tuple()[2:10], ref.as_tuple()[2:10]):
            assert torch.equal(x, y), (name, trial, s, bs, n, layer)
        assert got.seq_lengths == ref.seq_lengths and torch.equal(got.to_dense(), ref.to_dense())


def test_flex_under_the_anchor_built_mask_equals_the_dense_oracle():
    """flex_attention (eager, forward: CPU) under the plan's mask against SDPA under dense_block_mask."""
    g = torch.Generator().manual_seed(1)
    for trial in range(8):
        anchors, valid, s, bs, layer = _case(g, trial)
        b, n = anchors.shape
        q = torch.randn(b, 4, n * bs, 16, generator=g)
        kc, vc = (torch.randn(b, 2, s, 16, generator=g) for _ in range(2))
        kb, vb = (torch.randn(b, 2, n * bs, 16, generator=g) for _ in range(2))
        plans = [attention_plan(impl, anchors, valid, s, bs, needs_grad=False, layer=layer)
                 for impl in ("dense", "flex")]
        assert plans[1].impl == "flex"
        ref, got = (attend(q, kb, vb, kc, vc, plan) for plan in plans)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_mask_of_a_real_micro_batch_stays_small_where_the_dense_grid_is_gigabytes():
    """16 sequences x 512 anchors x block 16 against a 3,072-token context: the dense grid is
    B x Q x KV = 1.5G elements (its bool mask alone 1.4 GiB; create_block_mask ~10 bytes each,
    ~14 GiB); built from the anchors it stays under 32 MiB (measured 10 MiB: a few [B, Q] int64 rows, the tile
    tables)."""
    g = torch.Generator().manual_seed(0)
    b, n, bs, s = 16, 512, 16, 3072
    anchors = torch.stack([torch.randperm(s - 1, generator=g)[:n].sort().values + 1 for _ in range(b)])
    valid = torch.ones(b, n, dtype=torch.bool)
    assert b * n * bs * (s + n * bs) > 2**30  # the dense grid's elements
    for layer in (LayerMask(), LayerMask(window=2048, causal=True)):
        with LiveTensorBytes() as tracked:
            mask = flex_block_mask(anchors, valid, s, bs, layer)
        assert mask.kv_num_blocks.shape == (b, 1, n * bs // 128)
        assert tracked.peak < 32 * 2**20, f"building the mask took {tracked.peak / 2**20:.0f} MiB"


def test_the_byte_counter_counts_live_storage_once():
    """The tracker itself: two 4 MiB tensors alive together, a view of one free, one freed before a third."""
    with LiveTensorBytes() as tracked:
        a = torch.zeros(2**20)
        b = torch.ones(2**20)
        view = a[10:]  # the same storage: no more bytes
        del b
        c = torch.zeros(2**20)
        del view, a, c
    assert tracked.peak == 2 * 4 * 2**20 and tracked.now == 0
