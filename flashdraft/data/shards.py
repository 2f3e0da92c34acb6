"""flashdraft's on-disk token format, written once and memory-mapped on every open.

A token shard is a directory::

    meta.json       {"format": "flashdraft-tokens", "version": 1, "num_samples", "num_tokens",
                     "ids_dtype", "vocab_size", "source": {...free-form provenance...}}
    input_ids.bin   all samples' token ids back to back, in the narrowest unsigned dtype
                    that holds vocab_size (uint16 below 65,536, else uint32)
    loss_mask.bin   one uint8 per token, 1 where the token is supervised
    offsets.bin     int64[num_samples + 1]; sample i is [offsets[i], offsets[i + 1])
    num_supervised.bin  int32[num_samples]: loss_mask.sum() per sample (optional; written by
                    every writer here, so validation at open never scans the token files)

meta.json also records ``max_id`` (the largest id written) so the id-range check at open is one
comparison, and ``problems`` (samples a converter could not store faithfully, e.g. a mask whose
length differs from its ids; they are stored empty and reported by index at open).

Flat binary + offsets rather than Arrow because opening must cost three mmaps and a JSON
read, with no per-sample objects; docs/benchmarks.md has the comparison.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FORMAT = "flashdraft-tokens"
VERSION = 1
META = "meta.json"
IDS = "input_ids.bin"
MASK = "loss_mask.bin"
OFFSETS = "offsets.bin"
SUPERVISED = "num_supervised.bin"


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

    ``add`` takes one sample; ``add_flat`` takes many at once as flat arrays plus lengths (the
    form Arrow list columns already have), so converters never loop over samples in Python.
    """

    def __init__(self, out_dir: str | os.PathLike, vocab_size: int, source: dict | None = None):
        self.out_dir = Path(out_dir)
        self.vocab_size = int(vocab_size)
        self.dtype = ids_dtype_for(self.vocab_size)
        self.source = dict(source or {})
        if self.out_dir.exists() and not (is_token_shard(self.out_dir) or
                                          (self.out_dir.is_dir() and not any(self.out_dir.iterdir()))):
            # close() replaces the directory: never one that holds anything but an older shard
            raise ValueError(f"{self.out_dir}: exists and is not a token shard (nor empty); writing the shard "
                             "there would delete what it holds. Choose a new output directory.")
        self.tmp_dir = self.out_dir.with_name(f"{self.out_dir.name}.tmp-{os.getpid()}")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)
        self.tmp_dir.mkdir(parents=True)
        self._ids = open(self.tmp_dir / IDS, "wb")
        self._mask = open(self.tmp_dir / MASK, "wb")
        self._lengths: list[np.ndarray] = []
        self._supervised: list[np.ndarray] = []
        self.problems: dict[str, list] = {}
        self.num_samples = 0
        self.num_tokens = 0
        self.max_id = -1

    def add(self, input_ids, loss_mask) -> None:
        ids = np.asarray(input_ids)
        mask = np.asarray(loss_mask)
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise ValueError(
                f"sample {self.num_samples}: input_ids {ids.shape} and loss_mask {mask.shape} "
                "must be 1-D and of equal length"
            )
        self.add_flat(ids, mask, np.array([ids.size], dtype=np.int64))

    def add_flat(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` samples stored back to back in ``ids`` / ``mask`` (1-D, equal size)."""
        ids, mask = np.asarray(ids), np.asarray(mask)
        lengths = np.asarray(lengths, dtype=np.int64)
        if ids.shape != mask.shape or ids.ndim != 1 or int(lengths.sum()) != ids.size:
            raise ValueError(
                f"samples {self.num_samples}..: flat ids {ids.shape}, mask {mask.shape} and "
                f"lengths summing to {int(lengths.sum())} must agree"
            )
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = self.num_samples + _first_sample_with(ids, lengths, (ids < 0) | (ids >= self.vocab_size))
                raise ValueError(
                    f"sample {bad}: token id outside [0, {self.vocab_size}); pass the target tokenizer's "
                    "full vocab_size (including added tokens) or re-tokenize with the target's tokenizer"
                )
            self.max_id = max(self.max_id, hi)
        mask_u8 = mask if mask.dtype == np.uint8 and mask.max(initial=0) <= 1 else (mask != 0).astype(np.uint8)
        self._ids.write(ids.astype(self.dtype, copy=False).tobytes())
        self._mask.write(mask_u8.tobytes())
        # Per-sample supervised counts via a prefix sum: exact for empty samples too (reduceat is not).
        prefix = np.zeros(ids.size + 1, dtype=np.int64)
        np.cumsum(mask_u8, out=prefix[1:])
        ends = np.cumsum(lengths)
        self._supervised.append((prefix[ends] - prefix[ends - lengths]).astype(np.int32))
        self._lengths.append(lengths)
        self.num_samples += len(lengths)
        self.num_tokens += int(ids.size)

    def add_problem(self, kind: str, record: list) -> None:
        """Record a sample the caller stored empty because it could not be stored faithfully."""
        self.problems.setdefault(kind, []).append(record)

    def add_many(self, samples: Iterable[tuple]) -> None:
        for ids, mask in samples:
            self.add(ids, mask)

    def close(self) -> Path:
        self._ids.close()
        self._mask.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        offsets.tofile(self.tmp_dir / OFFSETS)
        supervised = np.concatenate(self._supervised) if self._supervised else np.zeros(0, np.int32)
        supervised.tofile(self.tmp_dir / SUPERVISED)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "ids_dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "max_id": self.max_id,
            "problems": self.problems,
            "source": self.source,
        }
        (self.tmp_dir / META).write_text(json.dumps(meta, indent=1))
        old = self.out_dir.with_name(f"{self.out_dir.name}.old-{os.getpid()}")
        if self.out_dir.exists():  # an older shard (checked in __init__): moved aside, then removed
            os.replace(self.out_dir, old)
        os.replace(self.tmp_dir, self.out_dir)
        shutil.rmtree(old, ignore_errors=True)
        return self.out_dir

    def abort(self) -> None:
        self._ids.close()
        self._mask.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> TokenShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _first_sample_with(values: np.ndarray, lengths: np.ndarray, bad: np.ndarray) -> int:
    """Index (within ``lengths``) of the sample holding the first True of per-token ``bad``."""
    first_token = int(np.argmax(bad))
    return int(np.searchsorted(np.cumsum(lengths), first_token, side="right"))


def write_token_shard(out_dir, samples: Iterable[tuple], vocab_size: int, source: dict | None = None) -> Path:
    """Write an iterable of (input_ids, loss_mask) pairs as one token shard; returns its path."""
    with TokenShardWriter(out_dir, vocab_size, source) as writer:
        writer.add_many(samples)
    return Path(out_dir)


def read_token_shard(path: str | os.PathLike) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """Memory-map a token shard: (meta, ids, loss_mask, offsets). No sample is touched.

    ids is a read-only memmap of ``meta["ids_dtype"]``, loss_mask a uint8 memmap, offsets an
    in-memory int64 array (8 bytes per sample).
    """
    path = Path(path)
    meta_file = path / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a flashdraft token shard (no {META}); "
                                "write one with `flashdraft prepare`")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{meta_file}: not valid JSON ({exc}); the shard is corrupt -- re-run `flashdraft prepare`") \
            from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{meta_file}: unsupported format {got!r}; expected {FORMAT!r} v{VERSION}")
    bad = [k for k in ("num_samples", "num_tokens", "vocab_size") if not isinstance(meta.get(k), int) or meta[k] < 0]
    if bad:
        raise ValueError(f"{meta_file}: field {bad[0]!r} is missing or not a non-negative integer "
                         f"({meta.get(bad[0])!r}); the shard is corrupt -- re-run `flashdraft prepare`")
    if meta.get("ids_dtype") not in ("uint16", "uint32"):
        raise ValueError(f"{meta_file}: ids_dtype {meta.get('ids_dtype')!r} is not uint16 or uint32 (the only id "
                         "types flashdraft writes); the shard is corrupt -- re-run `flashdraft prepare`")
    n, t = meta["num_samples"], meta["num_tokens"]
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


def read_num_supervised(path: str | os.PathLike, offsets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int32 supervised-token count per sample: from num_supervised.bin, else one prefix-sum pass."""
    file = Path(path) / SUPERVISED
    n = len(offsets) - 1
    if file.exists() and file.stat().st_size == n * 4:
        return np.fromfile(file, dtype=np.int32)
    prefix = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(mask != 0, out=prefix[1:])  # any non-zero byte is supervised, as in the objective
    return (prefix[offsets[1:]] - prefix[offsets[:-1]]).astype(np.int32)
