"""Convert tokenized datasets as users have them into a token shard, once, cached by content.

Sources: a Hugging Face ``save_to_disk`` directory (a Dataset, or a DatasetDict whose ``train``
split is used) or parquet files, with list columns ``input_ids`` and ``loss_mask`` (any integer
or bool type; ``seq_len`` and other columns are ignored). Columns are read a record batch at a
time as flat Arrow buffers, so no per-sample Python object is ever made.

The result lives in ``<cache_dir>/<source name>-<key>`` where ``key`` hashes, for every source
file, its relative name, size, mtime and first/last MiB, plus the converter version. Any edit
to the source therefore makes a new key (and a fresh conversion); the next run with an
unchanged source opens the cached shard instantly. Samples that cannot be stored faithfully
(mask length differs from ids, negative ids, ids >= 2**32, null rows) are stored EMPTY, keeping
the source's row numbering, and recorded in the shard's ``meta.json`` ``problems`` so that
``open_dataset`` reports them by index (or drops them) under the caller's ``on_invalid``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from flashdraft.data.shards import TokenShardWriter, is_token_shard

CONVERTER_VERSION = 1
_SAMPLE_BYTES = 1 << 20


def source_kind(path: str | os.PathLike) -> str:
    """'shard', 'hf' or 'parquet'; ValueError naming the accepted forms otherwise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir() and is_token_shard(path):
        return "shard"
    if path.is_dir() and any((path / n).exists() for n in ("state.json", "dataset_dict.json")):
        return "hf"
    if path.is_file() and path.suffix == ".parquet":
        return "parquet"
    if path.is_dir() and any(path.rglob("*.parquet")):
        return "parquet"
    raise ValueError(
        f"{path}: not a dataset flashdraft can read. Give a flashdraft token shard (meta.json), "
        "a Hugging Face save_to_disk directory (state.json), or parquet file(s) with list columns "
        "input_ids and loss_mask; raw chats go through `flashdraft prepare` first"
    )


def _hf_arrow_files(path: Path) -> list[Path]:
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split ({splits}); pass the split's directory, "
                             f"e.g. {path / splits[0]}" if splits else f"{path}: empty DatasetDict")
        path = path / "train"
    state = json.loads((path / "state.json").read_text())
    return [path / f["filename"] for f in state["_data_files"]]


def source_files(path: str | os.PathLike) -> list[Path]:
    """The data files a source consists of, in row order."""
    path = Path(path)
    kind = source_kind(path)
    if kind == "hf":
        return _hf_arrow_files(path)
    if kind == "parquet":
        return [path] if path.is_file() else sorted(path.rglob("*.parquet"))
    raise ValueError(f"{path} is already a token shard")


def content_key(path: str | os.PathLike) -> str:
    """Hash of the source's files (name, size, mtime, first and last MiB) and the converter version."""
    path = Path(path)
    h = hashlib.blake2b(digest_size=10)
    h.update(f"flashdraft-convert-v{CONVERTER_VERSION}".encode())
    for file in source_files(path):
        st = file.stat()
        rel = file.relative_to(path) if file != path else Path(file.name)
        h.update(f"|{rel}|{st.st_size}|{st.st_mtime_ns}|".encode())
        with open(file, "rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            if st.st_size > _SAMPLE_BYTES:
                f.seek(max(_SAMPLE_BYTES, st.st_size - _SAMPLE_BYTES))
                h.update(f.read())
    return h.hexdigest()


def default_cache_dir(path: str | os.PathLike) -> Path:
    """``<parent>/.flashdraft-cache`` next to the source if writable, else ``~/.cache/flashdraft``."""
    parent = Path(path).resolve().parent
    if os.access(parent, os.W_OK):
        return parent / ".flashdraft-cache"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashdraft"


# pyarrow is imported inside the functions that convert: opening an existing shard (every run
# after the first) must not pay its ~0.3 s import.


def _record_batches(files: list[Path], kind: str) -> Iterator:
    import pyarrow as pa

    for file in files:
        if kind == "hf":
            # save_to_disk writes Arrow IPC *stream* files; memory-mapped, so batches are zero-copy.
            with pa.memory_map(str(file)) as source:
                yield from pa.ipc.open_stream(source)
        else:
            import pyarrow.parquet as pq

            yield from pq.ParquetFile(file).iter_batches(batch_size=8192, columns=["input_ids", "loss_mask"])


def _num_rows(files: list[Path], kind: str) -> int:
    import pyarrow as pa

    if kind == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    return sum(sum(b.num_rows for b in pa.ipc.open_stream(pa.memory_map(str(f)))) for f in files)


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int64 with nulls as -1, flat values as numpy) of an Arrow list column."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(column).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    return lengths, values


def convert_to_shard(path: str | os.PathLike, out_dir: str | os.PathLike, *, progress: bool = True) -> Path:
    """Convert a HF save_to_disk dir or parquet source into a token shard at ``out_dir``.

    Two vectorised passes over the columns: the first finds the largest id (it decides the
    narrow ids dtype), the second writes. Row i of the source is sample i of the shard.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    path = Path(path)
    kind = source_kind(path)
    files = source_files(path)
    for batch in _record_batches(files[:1], kind):
        missing = [c for c in ("input_ids", "loss_mask") if c not in batch.schema.names]
        if missing:
            raise ValueError(
                f"{files[0]}: no column {missing[0]!r} (columns: {batch.schema.names}); flashdraft trains from "
                "input_ids + loss_mask (1 = supervised token). Run `flashdraft prepare` on the chats, or add "
                "the column"
            )
        for name in ("input_ids", "loss_mask"):
            field = batch.schema.field(name)
            value = (field.type.value_type if pa.types.is_list(field.type) or pa.types.is_large_list(field.type)
                     else None)
            ok = value is not None and (pa.types.is_integer(value)
                                        or (name == "loss_mask" and pa.types.is_boolean(value)))
            if not ok:
                raise ValueError(
                    f"{files[0]}: column {name!r} has type {field.type}; it must be a list of integers"
                    f"{' (or bools)' if name == 'loss_mask' else ' (token ids)'} -- re-tokenize, or cast the column "
                    "before converting (non-integer ids would be silently truncated)"
                )
        break
    max_id = 0
    for batch in _record_batches(files, kind):
        ids = pc.list_flatten(batch.column("input_ids"))
        if len(ids):
            max_id = max(max_id, min(pc.max(ids).as_py(), (1 << 32) - 1))
    total = _num_rows(files, kind)
    source = {"kind": kind, "path": str(path.resolve()), "files": [str(f) for f in files], "key": content_key(path)}
    row = 0
    with TokenShardWriter(out_dir, vocab_size=max_id + 1, source=source) as writer, tqdm(
        total=total, unit="sample", desc=f"flashdraft: converting {path.name}", disable=not progress
    ) as bar:
        for batch in _record_batches(files, kind):
            id_len, ids = _flat(batch.column("input_ids"))
            mask_len, mask = _flat(batch.column("loss_mask"))
            bad = (id_len != mask_len) | (id_len < 0)
            if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
                sample_of = np.repeat(np.arange(len(id_len)), np.maximum(id_len, 0))
                bad_ids = np.zeros(len(id_len), bool)
                bad_ids[sample_of[(ids < 0) | (ids >= 1 << 32)]] = True
                for i in np.flatnonzero(bad_ids & ~bad):
                    s = int(np.sum(np.maximum(id_len[:i], 0)))
                    vals = ids[s : s + id_len[i]]
                    writer.add_problem("id_out_of_range", [row + int(i), int(vals.min()), int(vals.max())])
                bad |= bad_ids
            for i in np.flatnonzero(bad):
                if id_len[i] < 0 or mask_len[i] < 0:
                    writer.add_problem("null_row", [row + int(i)])
                elif id_len[i] != mask_len[i]:
                    writer.add_problem("mask_length_mismatch", [row + int(i), int(id_len[i]), int(mask_len[i])])
            if bad.any():  # slow path: rebuild the flat arrays without the bad samples
                keep_tok_ids = np.repeat(~bad, np.maximum(id_len, 0))
                keep_tok_mask = np.repeat(~bad, np.maximum(mask_len, 0))
                ids, mask = ids[keep_tok_ids], mask[keep_tok_mask]
                id_len = np.where(bad, 0, id_len)
            writer.add_flat(ids, mask, id_len)
            row += len(id_len)
            bar.update(len(id_len))
    return Path(out_dir)


def cached_shard(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """The token shard for ``path``: from the cache if its content key matches, else converted now.

    In a multi-rank job (torchrun) the job's global rank 0 converts while every other rank waits
    at the start-up barrier (``distributed.startup_barrier``, under train.startup_timeout_s),
    then all open its result: one writer per job, whatever the filesystem's locking (none on
    Lustre without flock; per node on some NFS setups, where another node's ranks would replace
    shards under this node's memory maps). Every rank passes the barrier, converted or not, so
    the ranks never disagree about whether to wait. Rank 0 (or a lone process) also holds a
    lock file against another job converting the same source into the same cache; where the
    filesystem has no locks it converts unlocked (the shard is renamed into place whole).
    """
    from flashdraft import distributed

    path = Path(path)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(path)
    out = cache_dir / f"{path.name}-{content_key(path)}"
    failed: BaseException | None = None
    if distributed.get_dist().global_rank == 0 and not is_token_shard(out):
        try:
            _convert_locked(path, out, progress)
        except BaseException as exc:  # raised below, after the others were let go
            failed = exc
    distributed.startup_barrier(f"converting {path} into {out}")  # a failed rank 0 arrives too: none waits on
    if failed is not None:
        raise failed
    if not is_token_shard(out):
        raise ValueError(f"{out}: no token shard after rank 0 converted {path} (rank 0's log says why if it failed); "
                         "the conversion cache (next to the source when that directory is writable, else "
                         "~/.cache/flashdraft) must be on a filesystem every node shares: make the source's directory "
                         "writable, or convert it once beforehand and point data.path at the token shard")
    return out


def _convert_locked(path: Path, out: Path, progress: bool) -> None:
    """Convert ``path`` into ``out`` under the cache's lock file, unless another job just did."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # ENOSYS / ENOLCK: no locks here; this job's rank 0 is its only writer
            pass
        if not is_token_shard(out):
            convert_to_shard(path, out, progress=progress)
