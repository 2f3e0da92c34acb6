"""TokenDataset: a token shard opened by memory-mapping, validated in vectorised form at open.

``open_dataset`` accepts a flashdraft token shard, a Hugging Face ``save_to_disk`` directory,
a parquet file or a directory of parquet files; the last three are converted once into a
token shard cached by content (see ``flashdraft.data.convert``). Opening costs three mmaps,
one 8-byte-per-sample read of the offsets and a few array operations over per-sample arrays:
no token is read and no per-sample Python object is made.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashdraft.config import ON_INVALID
from flashdraft.data.shards import read_num_supervised, read_token_shard

# Problem kinds, in the order they are checked (a sample is counted under the first that hits).
# Each maps to the fix printed with it.
FIXES: dict[str, str] = {
    "null_row": "remove the null row from the source, or pass data.on_invalid=drop to skip such samples",
    "mask_length_mismatch": (
        "build input_ids and loss_mask from the same tokenization (one mask value per token), "
        "or pass data.on_invalid=drop to skip such samples"
    ),
    "id_out_of_range": (
        "re-tokenize with the target's tokenizer (or pass the tokenizer's full vocab_size including "
        "added tokens), or pass data.on_invalid=drop to skip such samples"
    ),
    "empty": "remove empty samples from the data, or pass data.on_invalid=drop to skip them",
    "too_few_supervised": (
        "check that loss_mask marks the assistant tokens (1 = supervised), lower data.min_supervised, "
        "raise data.max_length if truncation cut them, or pass data.on_invalid=drop to skip such samples"
    ),
}


@dataclass
class DataReport:
    """What open_dataset found: counts, plus up to 5 example messages per problem kind."""

    source: str
    samples_seen: int
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TokenDataset:
    """Zero-copy, validated view of a token shard.

    Attributes (one entry per KEPT sample, in source order):
      lengths     int64 [N], after truncation to max_length
      starts      int64 [N], offset of each sample's first token in ``ids`` / ``loss_mask``
      source_index int64 [N], the sample's row number in the source
      ids         [num_tokens] of the shard's ids dtype (uint16 / uint32), memory-mapped
      loss_mask   [num_tokens] uint8, memory-mapped
    ``dataset[i]`` returns numpy views (ids, loss_mask) into the memory map, copying nothing.
    Build one with ``open_dataset``.
    """

    def __init__(self, path, meta, ids, loss_mask, starts, lengths, source_index, vocab_size, report):
        self.path = Path(path)
        self.meta = meta
        self.ids = ids
        self.loss_mask = loss_mask
        self.starts = starts
        self.lengths = lengths
        self.source_index = source_index
        self.vocab_size = int(vocab_size)
        self.report: DataReport = report

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self.starts[i])
        end = start + int(self.lengths[i])
        return self.ids[start:end], self.loss_mask[start:end]

    @property
    def num_tokens(self) -> int:
        """Tokens in kept samples, after truncation."""
        return int(self.lengths.sum())

    def num_supervised(self) -> np.ndarray:
        """int64 [N]: loss_mask=1 tokens per kept sample, after truncation (reads num_supervised.bin;
        scans the mask only for truncated samples)."""
        offsets = np.fromfile(self.path / "offsets.bin", dtype=np.int64)
        full = read_num_supervised(self.path, offsets, self.loss_mask)[self.source_index].astype(np.int64)
        cut = np.flatnonzero(self.lengths < np.diff(offsets)[self.source_index])
        if len(cut):
            full[cut] = _prefix_counts(self.loss_mask, self.starts[cut], self.lengths[cut])
        return full

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.path)!r}, samples={len(self)}, tokens={self.num_tokens}, "
                f"vocab_size={self.vocab_size})")


def open_dataset(
    path: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    max_length: int | None = None,
    min_supervised: int = 0,
    on_invalid: str = "raise",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> TokenDataset:
    """Open training data as a validated, memory-mapped TokenDataset.

    path: a token shard, a HF save_to_disk dir, a parquet file or a dir of parquet files
      (the last three converted once, cached under ``cache_dir``; default next to the source).
    vocab_size: the target tokenizer's vocab size; ids must lie in [0, vocab_size). None: the
      shard's own (for converted sources: largest id + 1, i.e. unchecked).
    max_length: samples longer than this are truncated to it (counted in ``report.truncated``).
    min_supervised: samples with fewer loss_mask=1 tokens (after truncation) are invalid.
    on_invalid: "raise" -> ValueError naming the file, sample index, problem and fix;
      "drop" -> invalid samples are skipped and counted in ``report.dropped``.
    """
    if on_invalid not in ON_INVALID:
        raise ValueError(f"on_invalid={on_invalid!r}: use one of {', '.join(ON_INVALID)}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length={max_length}: use a positive token count (data.max_length)")
    shard, source, (meta, ids, mask, offsets) = _open_shard(Path(path), cache_dir, progress)
    vocab_size = int(vocab_size if vocab_size is not None else meta["vocab_size"])
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size}: pass the target tokenizer's vocab size")

    raw_lengths = np.diff(offsets)
    n = len(raw_lengths)
    # The checks run in FIXES order: a sample is counted under the first kind that flags it.
    problems = _Problems(n)
    _flag_recorded_problems(problems, meta, vocab_size)
    _flag_ids_out_of_range(problems, meta, ids, offsets, raw_lengths, vocab_size)
    problems.flag("empty", np.flatnonzero(raw_lengths == 0))
    lengths = raw_lengths if max_length is None else np.minimum(raw_lengths, max_length)
    truncated = np.flatnonzero(lengths < raw_lengths)
    if min_supervised > 0:
        _flag_too_few_supervised(problems, shard, offsets, mask, raw_lengths, lengths, truncated, min_supervised)

    report = _report(source, problems, raw_lengths)
    if report.dropped:
        if on_invalid == "raise":
            raise ValueError(_invalid_message(source, report))
        keep = problems.code == 0
        source_index = np.flatnonzero(keep)
        starts = offsets[:-1][keep]
        lengths = lengths[keep]
        report.kept = len(source_index)
        truncated = np.intersect1d(truncated, source_index, assume_unique=True)
    else:
        source_index = np.arange(n, dtype=np.int64)
        starts = offsets[:-1]
    report.truncated = int(len(truncated))
    # Plain ndarray views of the memmaps (same pages, no copy): slicing an np.memmap builds a
    # memmap object each time, which makes the per-sample slices of pad_batch ~2x slower.
    ids, mask = np.asarray(ids), np.asarray(mask)
    return TokenDataset(shard, meta, ids, mask, starts, lengths.astype(np.int64, copy=False), source_index, vocab_size,
                        report)


def _open_shard(path: Path, cache_dir, progress: bool) -> tuple[Path, Path, tuple]:
    """(shard dir, source to name in messages, read_token_shard(shard)) for any accepted source.

    A source other than a token shard is converted (once, cached by content); messages then name
    the user's source, not the cached shard.
    """
    from flashdraft.data.convert import cached_shard, source_kind

    source = path
    shard = path if source_kind(path) == "shard" else cached_shard(path, cache_dir, progress=progress)
    contents = read_token_shard(shard)
    meta = contents[0]
    if (meta.get("source") or {}).get("kind") in ("hf", "parquet"):  # converted here: name the user's source
        source = Path(meta["source"]["path"])
    return shard, source, contents


class _Problems:
    """Per-sample problem codes (0 = fine, k = index+1 into FIXES kinds) and example details."""

    def __init__(self, n: int):
        self.kinds = list(FIXES)
        self.code = np.zeros(n, dtype=np.int8)
        self.details: dict[str, dict[int, str]] = {k: {} for k in self.kinds}

    def flag(self, kind: str, idx: np.ndarray) -> np.ndarray:
        """Mark samples not already flagged; returns those newly marked."""
        idx = np.asarray(idx, dtype=np.int64)
        idx = idx[self.code[idx] == 0]
        self.code[idx] = self.kinds.index(kind) + 1
        return idx


def _flag_recorded_problems(problems: _Problems, meta: dict, vocab_size: int) -> None:
    """Flag the problems the converter recorded in the shard's meta (rows it could not store as given)."""
    for kind, records in (meta.get("problems") or {}).items():
        if kind not in FIXES or not records:
            continue
        rows = np.array([r[0] for r in records], dtype=np.int64)
        problems.flag(kind, rows)
        for r in records[:5]:
            if kind == "mask_length_mismatch":
                problems.details[kind][r[0]] = f"input_ids has {r[1]} tokens but loss_mask has {r[2]}"
            elif kind == "id_out_of_range":
                problems.details[kind][r[0]] = f"token ids span [{r[1]}, {r[2]}], outside [0, {vocab_size})"


def _flag_ids_out_of_range(problems: _Problems, meta: dict, ids, offsets: np.ndarray, raw_lengths: np.ndarray,
                           vocab_size: int) -> None:
    """Flag samples holding an id >= vocab_size."""
    if int(meta.get("max_id", vocab_size)) >= vocab_size:
        # Slow path, only when the shard's largest id is out of range: find the samples.
        nonempty = np.flatnonzero(raw_lengths > 0)
        sample_max = np.maximum.reduceat(np.asarray(ids), offsets[nonempty]) if len(nonempty) else np.zeros(0)
        bad = problems.flag("id_out_of_range", nonempty[sample_max >= vocab_size])
        for i in bad[:5]:
            problems.details["id_out_of_range"][int(i)] = (
                f"token id {int(ids[offsets[i]:offsets[i + 1]].max())} is >= vocab_size {vocab_size}"
            )


def _flag_too_few_supervised(problems: _Problems, shard: Path, offsets: np.ndarray, mask, raw_lengths: np.ndarray,
                             lengths: np.ndarray, truncated: np.ndarray, min_supervised: int) -> None:
    """Flag samples with fewer than ``min_supervised`` loss_mask=1 tokens after truncation."""
    supervised = read_num_supervised(shard, offsets, mask)
    if len(truncated):
        # Truncation can only remove supervised tokens: count exactly only the samples that
        # could fall below the threshold (full count minus tokens cut off < min_supervised).
        cut = raw_lengths[truncated] - lengths[truncated]
        unsure = truncated[supervised[truncated] - cut < min_supervised]
        if len(unsure):
            supervised = supervised.copy()
            supervised[unsure] = _prefix_counts(mask, offsets[unsure], lengths[unsure])
    few = problems.flag("too_few_supervised", np.flatnonzero(supervised < min_supervised))
    for i in few[:5]:
        problems.details["too_few_supervised"][int(i)] = (
            f"{int(supervised[i])} supervised tokens (loss_mask=1), fewer than min_supervised={min_supervised}"
        )


def _report(source: Path, problems: _Problems, raw_lengths: np.ndarray) -> DataReport:
    """DataReport with every sample kept, plus the counts and up to 5 examples of each flagged kind."""
    n = len(raw_lengths)
    report = DataReport(source=str(source), samples_seen=n, kept=n)
    code, kinds = problems.code, problems.kinds
    bad_rows = np.flatnonzero(code)
    if len(bad_rows):
        counts = np.bincount(code[bad_rows], minlength=len(kinds) + 1)
        report.dropped = {k: int(counts[j + 1]) for j, k in enumerate(kinds) if counts[j + 1]}
        for j, kind in enumerate(kinds):
            rows = bad_rows[code[bad_rows] == j + 1][:5]
            report.examples[kind] = [
                f"sample {int(i)}: {problems.details[kind].get(int(i), _default_detail(kind, int(raw_lengths[i])))}"
                for i in rows
            ]
        report.examples = {k: v for k, v in report.examples.items() if v}
    return report


def _prefix_counts(mask: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 count of nonzero mask[starts[i] : starts[i] + lengths[i]] for each i.

    One vectorised reduceat over interleaved (start, end) bounds; needs increasing starts,
    non-overlapping ranges and lengths >= 1 (true for samples in shard order).
    """
    if len(starts) < 2000:  # few ranges: slicing reads only them, reduceat reads the gaps too
        return np.array([np.count_nonzero(mask[a : a + n]) for a, n in zip(starts.tolist(), lengths.tolist())],
                        dtype=np.int64)
    bounds = np.empty(2 * len(starts), dtype=np.int64)
    bounds[0::2] = starts
    bounds[1::2] = starts + lengths
    if bounds[-1] >= len(mask):  # reduceat indices must be < len; the last range then runs to the end
        bounds = bounds[:-1]
    return np.add.reduceat(mask, bounds, dtype=np.int64)[0::2]


def _default_detail(kind: str, length: int) -> str:
    return {"empty": "has no tokens", "null_row": "is null"}.get(kind, kind.replace("_", " "))


def _invalid_message(source: Path, report: DataReport) -> str:
    lines = [f"{source}: {report.num_dropped} of {report.samples_seen} samples are invalid:"]
    for kind, count in report.dropped.items():
        lines.append(f"  {kind} ({count} samples), e.g. " + "; ".join(report.examples[kind][:3]))
        lines.append(f"    fix: {FIXES[kind]}")
    return "\n".join(lines)
