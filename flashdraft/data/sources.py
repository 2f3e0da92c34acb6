"""Reading conversation records from JSONL, JSON, parquet files and Hugging Face dataset dirs.

``iter_records`` streams ``(where, payload)`` pairs in a stable order: ``where`` names the file
and line (``data.jsonl:17``) or row (``data.parquet[16]``) for error messages; ``payload`` is
the raw bytes of a JSONL line (decoded later by ``decode_record``, so JSON parsing runs in the
worker processes) or an already-decoded dict. ``source_files`` lists the files behind the
inputs (for the cache key).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flashdraft.data.chat import SampleError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
FILE_SUFFIXES = JSONL_SUFFIXES + (".json", ".parquet")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS)


def expand_inputs(inputs: list[str | os.PathLike]) -> list[Path]:
    """Files and HF dataset dirs behind ``inputs`` (files, dirs of files, globs), in a stable order."""
    out: list[Path] = []
    for item in inputs:
        item = str(item)
        matches = sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
        if not matches:
            raise FileNotFoundError(f"{item}: no file matches")
        for match in matches:
            path = Path(match)
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file or directory")
            if is_hf_dataset_dir(path) or path.is_file():
                out.append(path)
            else:
                files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES))
                if not files:
                    raise FileNotFoundError(f"{path}: no {', '.join(FILE_SUFFIXES)} files and not a Hugging Face "
                                            "dataset directory (save_to_disk)")
                out.extend(files)
    return out


def source_files(inputs: list[str | os.PathLike]) -> list[Path]:
    """Every file whose content determines the records (HF dirs expand to their files)."""
    files = []
    for path in expand_inputs(inputs):
        files.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    return files


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield f"{path}:{n}", line


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):  # JSON Lines under a .json name
        yield from _iter_jsonl(path)
        return
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        # A broken JSON array cannot be read record by record: report the file as one bad record.
        yield f"{path}", SampleError("bad_json", f"{path}: not valid UTF-8 JSON ({exc}); fix the file or convert it "
                                                 "to JSON Lines so one bad record does not cost the whole file")
        return
    for n, record in enumerate(records):
        yield f"{path}[{n}]", record


def _rows(batch: dict) -> Iterator[dict]:
    keys = list(batch)
    for values in zip(*(batch[k] for k in keys)):
        yield dict(zip(keys, values))


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{path}[{n}]", row
            n += 1


def _iter_hf(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in ds else None
        if split not in ds:
            raise ValueError(f"{path}: a DatasetDict with splits {sorted(ds)}; choose one with --split")
        ds = ds[split]
    n = 0
    for batch in ds.iter(batch_size=1024):
        for row in _rows(batch):
            yield f"{path}[{n}]", row
            n += 1


def iter_records(inputs: list[str | os.PathLike], split: str | None = None) -> Iterator[tuple[str, Any]]:
    """Stream ``(where, payload)`` for every record of every input, in order (see module doc).

    A payload may also be a ``SampleError`` (a file that could not be read at all), which
    ``decode_record`` re-raises so it is counted like any bad record.
    """
    for path in expand_inputs(inputs):
        if path.is_dir():
            yield from _iter_hf(path, split)
        elif path.name.endswith(JSONL_SUFFIXES):
            yield from _iter_jsonl(path)
        elif path.name.endswith(".json"):
            yield from _iter_json(path)
        elif path.name.endswith(".parquet"):
            yield from _iter_parquet(path)
        else:
            raise ValueError(f"{path}: unsupported input; use {', '.join(FILE_SUFFIXES)} files or a Hugging Face "
                             "dataset directory")


def decode_record(where: str, payload: Any) -> Any:
    """A payload from ``iter_records`` -> the decoded record. Raises ``SampleError`` (bad_utf8, bad_json)."""
    if isinstance(payload, SampleError):
        raise payload
    if not isinstance(payload, bytes | bytearray):
        return payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SampleError("bad_utf8", f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                                      "re-encode the file as UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SampleError("bad_json", f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # no conversation nests hundreds of levels deep
        raise SampleError("bad_json", f"{where}: JSON nested too deeply to read") from None
