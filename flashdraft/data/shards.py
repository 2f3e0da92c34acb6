"""flashdraft's on-disk token format, written once and memory-mapped on every open.

A token shard is a directory::

    meta.json       {"format": "flashdraft-tokens", "version": 1, "num_samples", "num_tokens",
                     "ids_dtype", "vocab_size", "source": {...free-form provenance...}}
    input_ids.bin   all samples' token ids back to back, in the narrowest unsigned dtype
                    that holds vocab_size (uint16 below 65,536, else uint32)
    loss_mask.bin   one uint8 per token, 1 where the token is supervised
    offsets.bin     int64[num_samples + 1]; sample i is [offsets[i], offsets[i + 1])

Flat binary + offsets rather than Arrow because opening must cost three mmaps and a JSON
read, with no per-sample objects; docs/benchmarks.md has the comparison.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import numpy as np

FORMAT = "flashdraft-tokens"
VERSION = 1
META = "meta.json"
IDS = "input_ids.bin"
MASK = "loss_mask.bin"
OFFSETS = "offsets.bin"


def ids_dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id in [0, vocab_size)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_token_shard(path: str | os.PathLike) -> bool:
    meta = Path(path) / META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


class TokenShardWriter:
    """Streams (input_ids, loss_mask) samples into a token shard.

    Files are written into ``<out>.tmp-<pid>`` and renamed onto ``out`` by ``close()``, so a
    crash never leaves a half-written shard where a reader would open it. Use as a context
    manager; an exception inside the ``with`` discards the partial shard.
    """

    def __init__(self, out_dir: str | os.PathLike, vocab_size: int, source: dict | None = None):
        self.out_dir = Path(out_dir)
        self.vocab_size = int(vocab_size)
        self.dtype = ids_dtype_for(self.vocab_size)
        self.source = dict(source or {})
        self.tmp_dir = self.out_dir.with_name(f"{self.out_dir.name}.tmp-{os.getpid()}")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        self._ids = open(self.tmp_dir / IDS, "wb")
        self._mask = open(self.tmp_dir / MASK, "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0

    def add(self, input_ids, loss_mask) -> None:
        ids = np.asarray(input_ids)
        mask = np.asarray(loss_mask)
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise ValueError(
                f"sample {len(self._lengths)}: input_ids {ids.shape} and loss_mask {mask.shape} "
                "must be 1-D and of equal length"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"sample {len(self._lengths)}: token id outside [0, {self.vocab_size}); "
                "pass the target tokenizer's full vocab_size (including added tokens)"
            )
        self._ids.write(ids.astype(self.dtype, copy=False).tobytes())
        self._mask.write((mask != 0).astype(np.uint8).tobytes())
        self._lengths.append(int(ids.size))
        self.num_tokens += int(ids.size)

    def add_many(self, samples: Iterable[tuple]) -> None:
        for ids, mask in samples:
            self.add(ids, mask)

    def close(self) -> Path:
        self._ids.close()
        self._mask.close()
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        offsets.tofile(self.tmp_dir / OFFSETS)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "num_samples": len(self._lengths),
            "num_tokens": self.num_tokens,
            "ids_dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "source": self.source,
        }
        (self.tmp_dir / META).write_text(json.dumps(meta, indent=1))
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        self._ids.close()
        self._mask.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "TokenShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_shard(out_dir, samples: Iterable[tuple], vocab_size: int, source: dict | None = None) -> Path:
    """Write an iterable of (input_ids, loss_mask) pairs as one token shard; returns its path."""
    with TokenShardWriter(out_dir, vocab_size, source) as writer:
        writer.add_many(samples)
    return Path(out_dir)


def read_token_shard(path: str | os.PathLike) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """Memory-map a token shard: (meta, ids, loss_mask, offsets). No sample is touched."""
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a flashdraft token shard (no {META}); write one with `flashdraft prepare`")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{meta_file}: unsupported format {meta.get('format')!r} v{meta.get('version')}")
    n, t = int(meta["num_samples"]), int(meta["num_tokens"])
    dtype = np.dtype(meta["ids_dtype"])
    expected = {IDS: t * dtype.itemsize, MASK: t, OFFSETS: (n + 1) * 8}
    for name, size in expected.items():
        actual = (path / name).stat().st_size if (path / name).exists() else -1
        if actual != size:
            raise ValueError(
                f"{path / name}: {actual} bytes, expected {size} for {n} samples / {t} tokens; "
                "the shard is truncated or corrupt -- re-run `flashdraft prepare`"
            )
    ids = np.memmap(path / IDS, dtype=dtype, mode="r", shape=(t,)) if t else np.zeros(0, dtype)
    mask = np.memmap(path / MASK, dtype=np.uint8, mode="r", shape=(t,)) if t else np.zeros(0, np.uint8)
    offsets = np.fromfile(path / OFFSETS, dtype=np.int64)
    if offsets[0] != 0 or offsets[-1] != t or (n and np.any(np.diff(offsets) < 0)):
        raise ValueError(f"{path / OFFSETS}: offsets are not a non-decreasing run from 0 to {t}; the shard is corrupt")
    return meta, ids, mask, offsets
