"""The disaggregated link's wire format (flashdraft.feed.wire), without a process group: what a
target rank encodes, a drafter rank decodes to the same step; the HELLO carries the sampler's
whole cursor; a failure's message crosses whole (up to its cap)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdraft.data.batching import BatchSampler, DrafterRows
from flashdraft.data.collate import Batch
from flashdraft.feed import wire
from flashdraft.feed.steps import Micro, StepInput


def _sampler() -> BatchSampler:
    return BatchSampler(np.arange(20, 60), token_budget=256, max_batch_size=4, seed=3,
                        rows=DrafterRows(budget=512, num_anchors=8, block_size=4))


def test_the_hello_carries_the_samplers_whole_cursor():
    """CURSOR_KEYS must be BatchSampler.state_dict()'s keys, all of them, in a fixed order: a
    resumed drafter rank tells its target rank where the data stands."""
    sampler = _sampler()
    next(iter(sampler))
    cursor = sampler.state_dict()
    assert set(wire.CURSOR_KEYS) == set(cursor)
    msg = wire.hello(7, 100, 1, 3, cursor)
    assert msg.dtype == torch.int64 and msg.numel() == wire.HELLO_SIZE
    assert wire.read_hello(msg) == (7, 100, 1, 3, cursor)


def _micro(rows: int, seq: int, width: int, dtype, seed: int) -> Micro:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    lengths[0] = seq
    batch = Batch(torch.randint(0, 1000, (rows, seq), generator=g), torch.randint(0, 2, (rows, seq), generator=g,
                  dtype=torch.uint8), torch.ones(rows, seq, dtype=torch.int64), lengths)
    return Micro(batch, np.arange(rows, dtype=np.int64) * 10 + seed, device_batch=batch,
                 features=torch.randn(rows, seq, width, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", wire.FEATURE_DTYPES)
def test_a_step_header_decodes_to_the_step_it_encodes(dtype):
    """grad_accum 3, a last step holding 2 micro-batches of 3 and 1 rows (max_batch_size 4): the
    header has FIXED + 3 * (2 + 2 * 4) int64s; the drafter side reads back each micro-batch's
    shape, lengths and sample ids, the features' width and dtype, the cursor and a stop signal;
    the payload is each micro-batch's input_ids, loss_mask, attention_mask and features, in order."""
    header = wire.Header(grad_accum=3, max_batch_size=4)
    assert header.size == wire.Header.FIXED + 3 * (2 + 2 * 4)
    micro = [_micro(3, 9, 12, dtype, seed=1), _micro(1, 5, 12, dtype, seed=2)]
    sampler = _sampler()
    next(iter(sampler))
    h, payload = header.step(StepInput(micro, [], sampler.state_dict()), signum=15)
    assert h.shape == (header.size,) and int(h[0]) == wire.DATA and int(h[1]) == 15
    assert header.features(h) == (12, dtype)
    assert header.cursor(h) == sampler.state_dict()
    decoded = header.micro_batches(h)
    assert [(rows, seq) for rows, seq, _, _ in decoded] == [(3, 9), (1, 5)]
    for (_, _, lengths, ids), m in zip(decoded, micro):
        assert torch.equal(lengths, m.batch.lengths) and np.array_equal(ids, m.sample_ids)
    expected = [t for m in micro for t in (m.batch.input_ids, m.batch.loss_mask, m.batch.attention_mask, m.features)]
    assert len(payload) == len(expected) and all(torch.equal(a, b) for a, b in zip(payload, expected))
    assert [t.dtype for t in payload[:3]] == list(wire.BATCH_DTYPES.values())


def test_an_abort_carries_its_message_and_an_end_nothing():
    header = wire.Header(grad_accum=1, max_batch_size=2)
    text = "target rank 3 failed: CUDA out of memory — é" * 200
    h, payload = header.control(wire.ABORT, text)
    assert int(h[0]) == wire.ABORT and int(h[1]) == payload[0].numel() == 4000
    assert bytes(payload[0].tolist()) == text.encode()[:4000]
    h, payload = header.control(wire.END)
    assert int(h[0]) == wire.END and payload == []
