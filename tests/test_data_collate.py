"""pad_batch is bit-identical to a slow, obviously-correct reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdraft.data.batching import build_batches
from flashdraft.data.collate import CollateBuffers, pad_batch
from flashdraft.data.dataset import open_dataset
from flashdraft.data.shards import write_token_shard


def reference_pad(samples, pad_id):
    """Python lists, one row at a time: what pad_batch must equal exactly."""
    width = max(len(ids) for ids, _ in samples)
    ids = [list(map(int, i)) + [pad_id] * (width - len(i)) for i, _ in samples]
    mask = [list(map(int, m)) + [0] * (width - len(m)) for _, m in samples]
    attn = [[1] * len(i) + [0] * (width - len(i)) for i, _ in samples]
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.uint8),
            torch.tensor(attn, dtype=torch.int64), torch.tensor([len(i) for i, _ in samples], dtype=torch.int64))


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    rng = np.random.default_rng(0)
    vocab = 100_000  # > 65,536: ids stored as uint32
    lengths = rng.integers(1, 400, 300)
    samples = [(rng.integers(0, vocab, n), rng.integers(0, 2, n)) for n in lengths]
    path = write_token_shard(tmp_path_factory.mktemp("c") / "s", samples, vocab_size=vocab)
    return path, samples


@settings(max_examples=80, deadline=None)
@given(budget=st.integers(400, 6000), max_bs=st.integers(1, 32), seed=st.integers(0, 10**6),
       max_length=st.one_of(st.none(), st.integers(1, 500)), pad_id=st.integers(0, 99_999), reuse=st.booleans())
def test_pad_batch_matches_reference(shard, budget, max_bs, seed, max_length, pad_id, reuse):
    path, samples = shard
    ds = open_dataset(path, max_length=max_length)
    buffers = CollateBuffers() if reuse else None
    plan = build_batches(ds.lengths, token_budget=budget, max_batch_size=max_bs, seed=seed, epoch=0)
    for batch_idx in plan[:6]:
        got = pad_batch(ds, batch_idx, buffers=buffers, pad_id=pad_id)
        cut = max_length or 10**9
        want = reference_pad([(samples[i][0][:cut], samples[i][1][:cut]) for i in batch_idx], pad_id)
        for g, w in zip((got.input_ids, got.loss_mask, got.attention_mask, got.lengths), want):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(g, w)


def test_buffers_are_reused(shard):
    path, _ = shard
    ds = open_dataset(path)
    buffers = CollateBuffers(pin_memory=False)
    pad_batch(ds, np.arange(8), buffers=buffers)
    ptr = buffers.ids_t.data_ptr()
    b = pad_batch(ds, np.arange(3, 9), buffers=buffers)
    assert buffers.ids_t.data_ptr() == ptr and b.input_ids.data_ptr() == ptr
    moved = b.to("cpu")
    assert torch.equal(moved.input_ids, b.input_ids)


def test_empty_indices_rejected(shard):
    ds = open_dataset(shard[0])
    with pytest.raises(ValueError, match="non-empty"):
        pad_batch(ds, [])
