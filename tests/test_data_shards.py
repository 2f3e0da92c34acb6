"""Token shard format: round trip, narrow dtypes, bulk writes, atomic close."""

import json

import numpy as np
import pytest

from flashdraft.data.shards import (
    TokenShardWriter,
    ids_dtype_for,
    is_token_shard,
    read_num_supervised,
    read_token_shard,
    write_token_shard,
)


def test_round_trip_and_layout(tmp_path):
    samples = [([1, 2, 3], [0, 1, 1]), ([7], [1]), ([4, 5], [0, 0])]
    out = write_token_shard(tmp_path / "s", samples, vocab_size=10, source={"from": "test"})
    meta, ids, mask, offsets = read_token_shard(out)
    assert meta["num_samples"] == 3 and meta["num_tokens"] == 6 and meta["max_id"] == 7
    assert ids.dtype == np.uint16 and mask.dtype == np.uint8 and isinstance(ids, np.memmap)
    assert offsets.tolist() == [0, 3, 4, 6]
    assert ids.tolist() == [1, 2, 3, 7, 4, 5] and mask.tolist() == [0, 1, 1, 1, 0, 0]
    assert read_num_supervised(out, offsets, mask).tolist() == [2, 1, 0]
    assert (out / "input_ids.bin").stat().st_size == 6 * 2  # narrowest dtype on disk
    assert is_token_shard(out)


def test_narrowest_dtype():
    assert ids_dtype_for(65536) == np.uint16
    assert ids_dtype_for(65537) == np.uint32
    with pytest.raises(ValueError):
        ids_dtype_for(0)


def test_add_flat_matches_add(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 20, 50)
    ids = rng.integers(0, 200_000, lengths.sum())
    mask = rng.integers(0, 2, lengths.sum()).astype(bool)
    with TokenShardWriter(tmp_path / "a", 200_000) as w:
        w.add_flat(ids, mask, lengths)
    with TokenShardWriter(tmp_path / "b", 200_000) as w:
        ends = np.cumsum(lengths)
        for e, n in zip(ends, lengths):
            w.add(ids[e - n : e], mask[e - n : e])
    a, b = read_token_shard(tmp_path / "a"), read_token_shard(tmp_path / "b")
    assert a[1].dtype == np.uint32
    for x, y in zip(a[1:], b[1:]):
        np.testing.assert_array_equal(x, y)
    sup = read_num_supervised(tmp_path / "a", a[3], a[2])
    np.testing.assert_array_equal(sup, np.add.reduceat(np.r_[mask, 0].astype(int), np.r_[0, ends[:-1]]) * (lengths > 0))


def test_writer_rejects_bad_ids_naming_sample(tmp_path):
    with pytest.raises(ValueError, match=r"sample 1: token id outside \[0, 10\).*tokenizer"):
        write_token_shard(tmp_path / "s", [([1], [1]), ([3, 12], [1, 1])], vocab_size=10)
    assert not (tmp_path / "s").exists()  # exception inside the writer discards the partial shard
    assert not list(tmp_path.iterdir())


def test_truncated_shard_is_reported(tmp_path):
    out = write_token_shard(tmp_path / "s", [([1, 2, 3], [1, 1, 1])], vocab_size=10)
    (out / "input_ids.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_token_shard(out)


def test_meta_is_json(tmp_path):
    out = write_token_shard(tmp_path / "s", [], vocab_size=10)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_samples"] == 0
    assert read_token_shard(out)[3].tolist() == [0]
