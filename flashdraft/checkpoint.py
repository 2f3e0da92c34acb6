"""Atomic, verifiable training checkpoints: the only module that reads or writes them.

On-disk format (safetensors and JSON only -- nothing is ever unpickled)::

    <root>/
      latest                      text file naming the newest checkpoint ("step_00000500")
      step_00000500/
        <part>.safetensors        the tensors of one state (drafter, optimizer, scheduler, ...)
        <part>.json               its skeleton: the non-tensor structure (see flatten_state)
        <name>_rank<r>.*          per-rank parts (e.g. rng_rank0, rng_rank1), one per rank
        config.json               the resolved run config (optional)
        export/...                whatever ``export_fn`` wrote (e.g. the serving-format drafter)
        manifest.json             written LAST: every other file with its size and sha256

A checkpoint is complete iff its manifest exists and every listed file has the listed size
and sha256. Writes go to ``<root>/.tmp-step_XXXXXXXX-<pid>``; files and the directory are
fsynced, the manifest is written last, then the directory is renamed into place and the
``latest`` pointer replaced atomically. A crash at any moment therefore leaves either the
previous checkpoints untouched plus a stale temp dir (removed on the next load) or the new,
complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

from flashdraft import __version__, distributed
from flashdraft.config import upgrade_saved

log = logging.getLogger(__name__)

FORMAT = "flashdraft-checkpoint"
# 2: the training state records the run's identity (target, data, MASK id); 1 did not.
# 3: the manifest carries a digest of itself. Reading an older version's parts is the
# caller's to adapt (flashdraft.train.state.upgrade_parts).
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
CONFIG = "config.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_RESERVED = {"manifest", "config", "export"}
_MAX_JSON_INT = 2**53  # larger ints are written as strings so any JSON reader keeps them exact


_REPLACED = ".replaced-"  # prefix of a step directory being replaced by a re-save of the same step


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path."""

    names_the_fix = True  # the command line reports it as one line (cli.entry)


# --------------------------------------------------------------------------------------------
# Generic state <-> (tensors, JSON skeleton)
# --------------------------------------------------------------------------------------------

def flatten_state(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state into flat named tensors and a JSON-able skeleton.

    Supported leaves: torch.Tensor (any device; returned detached, contiguous, on CPU, never
    sharing storage with another returned tensor), numpy arrays and scalars, int (any size),
    float (incl. nan/inf), bool, None, str. Containers: dict and OrderedDict (keys: str, int,
    float, bool or None), list, tuple. This covers optimizer / LR scheduler state_dicts, torch / numpy /
    python RNG states and data cursors. ``unflatten_state`` inverts it exactly: same container
    and leaf types, bit-identical tensors. Raises TypeError naming the path of anything else.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()

    def add_tensor(path: str, t: torch.Tensor) -> str:
        name = path or "_"
        if name in tensors:  # e.g. keys "a.b" and ("a", "b") flatten to the same path
            i = 1
            while f"{name}#{i}" in tensors:
                i += 1
            name = f"{name}#{i}"
        t = t.detach().to("cpu")
        # safetensors refuses tensors that share memory and writes only contiguous data; copy
        # only when needed so large CPU states are not duplicated in memory.
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if not t.is_contiguous() or (ptr is not None and ptr in seen_storages) \
                or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None:
            seen_storages.add(ptr)
        tensors[name] = t
        return name

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, np.generic):  # before float: np.float64 subclasses float
            if x.dtype.hasobject:
                raise TypeError(f"state at {path or '<root>'}: numpy object scalars are not supported")
            return {"npscalar": x.dtype.str, "hex": x.tobytes().hex()}
        if x is None or isinstance(x, bool | str):
            return x
        if isinstance(x, int):
            return x if abs(x) < _MAX_JSON_INT else {"int": str(x)}
        if isinstance(x, float):
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, torch.Tensor):
            return {"tensor": add_tensor(path, x)}
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise TypeError(f"state at {path or '<root>'}: numpy object arrays are not supported")
            raw = torch.from_numpy(np.frombuffer(np.ascontiguousarray(x).tobytes(), dtype=np.uint8).copy())
            return {"ndarray": add_tensor(path, raw), "dtype": x.dtype.str, "shape": list(x.shape)}
        if isinstance(x, tuple):
            return {"tuple": [enc(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(x)]
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not (k is None or isinstance(k, str | int | float | bool)) or isinstance(k, np.generic):
                    raise TypeError(f"state at {path or '<root>'}: dict key {k!r} of type {type(k).__name__} "
                                    "is not supported (use str, int, float, bool or None)")
                items.append([enc(k, path), enc(v, f"{path}.{k}" if path else str(k))])
            # OrderedDict (module state_dicts) keeps its type; its ``_metadata`` attribute
            # (per-module version numbers) is not kept -- load_state_dict does not need it.
            return {"odict": items} if isinstance(x, OrderedDict) else {"dict": items}
        raise TypeError(f"state at {path or '<root>'}: type {type(x).__module__}.{type(x).__qualname__} "
                        "is not supported; convert it to tensors, numbers, strings, lists or dicts")

    skeleton = enc(obj, "")
    return tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Rebuild the object ``flatten_state`` split; raises CheckpointError on a malformed skeleton."""

    def dec(s: Any) -> Any:
        if s is None or isinstance(s, bool | int | float | str):
            return s
        if isinstance(s, list):
            return [dec(v) for v in s]
        if isinstance(s, dict) and len(s) >= 1:
            if "tensor" in s:
                return tensors[s["tensor"]]
            if "dict" in s:
                return {dec(k): dec(v) for k, v in s["dict"]}
            if "odict" in s:
                return OrderedDict((dec(k), dec(v)) for k, v in s["odict"])
            if "tuple" in s:
                return tuple(dec(v) for v in s["tuple"])
            if "int" in s:
                return int(s["int"])
            if "float" in s:
                return float(s["float"])
            if "ndarray" in s:
                raw = tensors[s["ndarray"]].numpy().tobytes()
                return np.frombuffer(raw, dtype=np.dtype(s["dtype"])).reshape(s["shape"]).copy()
            if "npscalar" in s:
                return np.frombuffer(bytes.fromhex(s["hex"]), dtype=np.dtype(s["npscalar"]))[0]
        raise CheckpointError(f"malformed checkpoint skeleton node: {str(s)[:200]}")

    try:
        return dec(skeleton)
    except KeyError as exc:
        raise CheckpointError(f"checkpoint skeleton references missing tensor {exc}") from None


# --------------------------------------------------------------------------------------------
# File helpers
# --------------------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes renames and new directory entries durable; not supported on every platform.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only be
    read by setting it, which would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give a file written by safetensors or tempfile (whose writers create it 0600; a directory
    from tempfile.mkdtemp, 0700) the mode the umask gives any other (0644 by default, 0755 for a
    directory): a serving process of another user must be able to read it."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_umask())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _write_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def _serialize_part(state: Any) -> tuple[bytes, bytes]:
    """(safetensors bytes, skeleton JSON bytes) of one state."""
    tensors, skeleton = flatten_state(state)
    return safetensors.torch.save(tensors), (json.dumps(skeleton, allow_nan=False) + "\n").encode()


def _write_part(tmp: Path, name: str, state: Any) -> None:
    tensors, skeleton = flatten_state(state)
    path = tmp / f"{name}.safetensors"
    try:
        safetensors.torch.save_file(tensors, str(path))
    except safetensors.SafetensorError as exc:  # its Rust writer reports ENOSPC / EFBIG this way, not as OSError
        raise CheckpointError(f"{path}: {exc}") from exc
    follow_umask(path)
    _fsync_file(path)
    _write_bytes(tmp / f"{name}.json", (json.dumps(skeleton, allow_nan=False) + "\n").encode())


def _read_part(ckpt: Path, name: str) -> Any:
    tensors = safetensors.torch.load_file(str(ckpt / f"{name}.safetensors"), device="cpu")
    skeleton = json.loads((ckpt / f"{name}.json").read_text())
    return unflatten_state(tensors, skeleton)


def _read_part_files(ckpt: Path, name: str) -> tuple[bytearray, bytes]:
    """One part's two files' bytes (what rank 0 reads once and broadcasts on resume)."""
    path = ckpt / f"{name}.safetensors"
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        if f.readinto(data) != len(data):
            raise OSError(f"{path}: short read")
    with open(ckpt / f"{name}.json", "rb") as f:
        return data, f.read()


def _parse_part(data: bytearray, skeleton: bytes) -> Any:
    """The state of a part from its files' bytes; the tensors are views of ``data`` (writable,
    no copy: safetensors.torch.load would copy each tensor and make it read-only)."""
    size = int.from_bytes(data[:8], "little")
    header, base = json.loads(data[8 : 8 + size]), 8 + size
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, (start, stop) = safetensors.torch._getdtype(info["dtype"]), info["data_offsets"]
        count = (stop - start) // dtype.itemsize
        tensors[key] = (torch.frombuffer(data, dtype=dtype, count=count, offset=base + start) if count
                        else torch.empty(0, dtype=dtype)).reshape(info["shape"])
    return unflatten_state(tensors, json.loads(skeleton))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Return the manifest of a complete checkpoint, else raise CheckpointError saying why.

    Reads every listed file once (sizes first, then sha256).
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial or not a checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{mpath}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: not a {FORMAT} manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{mpath}: format version {manifest.get('version')} unsupported (this version of "
                              f"flashdraft reads {', '.join(map(str, READABLE_VERSIONS))})")
    _check_manifest(path, manifest)
    files = manifest["files"]
    for rel, meta in files.items():
        f = path / rel
        try:
            size = f.stat().st_size
        except OSError:
            raise CheckpointError(f"{f}: listed in the manifest but missing") from None
        if size != meta["size"]:
            raise CheckpointError(f"{f}: size {size} != {meta['size']} in the manifest (truncated or modified)")
    for rel, meta in files.items():
        if sha256_file(path / rel) != meta["sha256"]:
            raise CheckpointError(f"{path / rel}: sha256 mismatch (corrupted)")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content (every key but ``digest``, canonical JSON): an edit that
    keeps it valid JSON (a dropped file entry, another world_size) no longer goes unnoticed."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_manifest(path: Path, manifest: dict) -> None:
    """The manifest's own integrity: its digest (format 3 on), entries confined to the checkpoint
    directory, every file there listed, every part's files present, a sane step and world size."""
    mpath, files = path / MANIFEST, manifest["files"]
    if manifest["version"] >= 3 and manifest.get("digest") != manifest_digest(manifest):
        raise CheckpointError(f"{mpath}: edited or damaged (its digest does not match its content)")
    root = path.resolve()
    for rel, meta in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not isinstance(meta, dict) \
                or not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str) \
                or not (path / rel).resolve().is_relative_to(root):
            raise CheckpointError(f"{mpath}: malformed entry {rel!r} (files must lie inside the checkpoint)")
    unlisted = sorted({f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file() or f.is_symlink()}
                      - set(files) - {MANIFEST})
    if unlisted:
        raise CheckpointError(f"{mpath}: files not in the manifest: {', '.join(unlisted[:5])} (edited or damaged)")
    world, step = manifest.get("world_size"), manifest.get("step")
    if not isinstance(world, int) or world < 1 or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{mpath}: malformed step {step!r} or world_size {world!r}")
    needed = [f"{name}.{ext}" for name in manifest.get("parts", []) for ext in ("safetensors", "json")]
    needed += [f"{name}_rank{r}.{ext}" for name in manifest.get("per_rank_parts", []) for r in range(world)
               for ext in ("safetensors", "json")]
    missing = [n for n in needed if n not in files]
    if missing:
        raise CheckpointError(f"{mpath}: the manifest's parts lack their files ({', '.join(missing[:5])})")


# --------------------------------------------------------------------------------------------
# Manager
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Loaded:
    """What load / load_latest return: unpack as ``step, parts, config = ...``; ``version`` is
    the checkpoint's format version (parts of an older version may need adapting)."""

    step: int
    parts: dict[str, Any]
    config: dict | None
    version: int = VERSION

    def __iter__(self):
        return iter((self.step, self.parts, self.config))


def _warn_if_slow(seconds: float, path: Path) -> None:
    """Warn when a save took over half of the pause clock the other ranks wait for it under, so
    the clock is raised before a save outgrows it (a larger drafter, slower storage)."""
    limit = distributed.clock("pause")
    if distributed.get_world_size() > 1 and seconds > limit / 2:
        log.warning("saving %s took %.0f s, over half of the %s the other ranks wait for it: raise it before a "
                    "slower save fails the job", path, seconds, distributed.describe_clock("pause"))


class CheckpointDir:
    """A run's checkpoint directory, rank-local: the step directories, the ``latest`` pointer,
    rank 0's atomic write of one checkpoint, the pruning to ``keep_last`` and the housekeeping of
    interrupted saves and abandoned timelines. CheckpointManager adds the job-wide protocol."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} is invalid: keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Step directories under root, newest first (complete or not)."""
        if not self.root.is_dir():
            return []
        entries = [(s, p) for p in self.root.iterdir() if (s := _parse_step(p.name)) is not None and p.is_dir()]
        return [p for _, p in sorted(entries, reverse=True)]

    def latest_complete(self) -> Path | None:
        """The newest checkpoint whose manifest verifies (rank-local, reads every file)."""
        for p in self.checkpoints():
            try:
                verify_checkpoint(p)
                return p
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", p, exc)
        return None

    def write(self, step: int, final: Path, parts: Mapping[str, Any], gathered: list[dict[str, tuple[bytes, bytes]]],
               world: int, config: dict | None, export_fn: Callable[[Path], None] | None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir()
            for name, state in parts.items():
                _write_part(tmp, name, state)
            for r, payload in enumerate(gathered):
                for name, (st_bytes, skel_bytes) in payload.items():
                    _write_bytes(tmp / f"{name}_rank{r}.safetensors", st_bytes)
                    _write_bytes(tmp / f"{name}_rank{r}.json", skel_bytes)
            if config is not None:
                _write_json(tmp / CONFIG, config)
            if export_fn is not None:
                ours = set(tmp.iterdir())
                export_fn(tmp)
                for f in tmp.rglob("*"):  # the caller's files: make them as durable as ours
                    if f.is_file() and f not in ours:
                        _fsync_file(f)
            files = {}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                files[f.relative_to(tmp).as_posix()] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
            for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                _fsync_dir(d)
            manifest = {"format": FORMAT, "version": VERSION, "flashdraft_version": __version__,
                        "step": step, "world_size": world,
                        "parts": list(parts), "per_rank_parts": sorted(gathered[0]) if gathered else [],
                        "files": files}
            manifest["digest"] = manifest_digest(manifest)
            _write_json(tmp / MANIFEST, manifest)  # last: its presence marks the directory complete
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step after resuming from an earlier one: the old copy is kept aside
                trash = self.root / f"{_REPLACED}{final.name}-{os.getpid()}"  # restored if we die before the next line
                os.replace(final, trash)
                os.replace(tmp, final)
                self.set_aside(trash, final.name, f"a run resumed from an earlier step saved step {step} again")
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.set_latest(final.name)
        self.prune(step, final.name)

    def set_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp-{os.getpid()}"
        try:
            _write_bytes(tmp, (name + "\n").encode())
            os.replace(tmp, self.root / LATEST)
            _fsync_dir(self.root)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"{self.root / name} is complete but updating {self.root / LATEST} failed: {exc}") \
                from exc

    def read_latest_pointer(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except OSError:
            return None

    def prune(self, step: int, just_written: str) -> None:
        """Remove complete checkpoints older than the newest ``keep_last``; never one this save did
        not supersede. "Complete" here means "has a manifest" (cheap); loading verifies hashes.
        A checkpoint with a step above the one just written belongs to a timeline abandoned by
        resuming from an earlier step: it is moved out of the way (``abandoned-step_X``, kept on
        disk), since the next load_latest would resume from it; a damaged one stays (loads skip
        it, and a save of its step moves it aside like a complete one)."""
        protected = {just_written, self.read_latest_pointer()}
        entries = sorted(((s, p) for p in self.root.iterdir() if (s := _parse_step(p.name)) is not None), reverse=True)
        kept = 0
        for s, p in entries:  # newest first
            complete = (p / MANIFEST).is_file()
            if s > step:
                if complete:
                    self.set_aside(p, p.name, f"it is newer than the checkpoint just written (step {step}), from a "
                                               "run that was resumed from an earlier step")
                continue
            elif p.name in protected:
                kept += complete
                continue
            elif not complete:
                continue  # partial or damaged: load_latest skips it with a warning
            elif kept < self.keep_last:
                kept += 1
                continue
            # Rename first so a crash mid-delete leaves a stale temp dir, never a damaged step dir.
            doomed = self.root / f".tmp-prune-{p.name}-{os.getpid()}"
            try:
                os.replace(p, doomed)
            except OSError as exc:
                log.warning("could not prune %s: %s", p, exc)
                continue
            shutil.rmtree(doomed, ignore_errors=True)

    def set_aside(self, path: Path, name: str, why: str) -> None:
        """Keep checkpoint ``name`` (now at ``path``) of an abandoned timeline as ``abandoned-NAME``:
        out of load_latest's way, never deleted by flashdraft."""
        dest, n = self.root / f"abandoned-{name}", 1
        while dest.exists():
            dest, n = self.root / f"abandoned-{name}-{n}", n + 1
        try:
            os.replace(path, dest)
        except OSError as exc:
            log.warning("could not move %s aside: %s", path, exc)
            return
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
        log.warning("kept %s of an abandoned run as %s (%.1f MB): %s; delete it once you no longer need it",
                    name, dest, size / 1e6, why)

    def remove_stale_tmp(self) -> None:
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.startswith(_REPLACED):  # a re-save of this step died between its two renames
                name = p.name[len(_REPLACED):].rsplit("-", 1)[0]
                if not (self.root / name).exists() and (p / MANIFEST).is_file():
                    log.warning("restoring checkpoint %s: a re-save of it was interrupted", name)
                    os.replace(p, self.root / name)
                else:
                    shutil.rmtree(p, ignore_errors=True)
                continue
            if p.name.startswith(".tmp-") or p.name.startswith(f".{LATEST}.tmp-"):
                log.warning("removing stale partial checkpoint %s (a save was interrupted)", p)
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


class CheckpointManager:
    """Saves and restores training state under ``root``, keeping the last ``keep_last``.

    ``save`` and ``load_latest`` are collective in a distributed job: call them on every rank,
    in the same order. Rank 0 writes files and picks the checkpoint to load; other ranks
    exchange small control data with it. ``load``, ``checkpoints`` and ``latest_complete``
    are rank-local.
    ``root`` must be visible to all ranks at the same path (a shared filesystem for
    multi-node jobs) for loading; saving writes from rank 0 only.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 3):
        self.dir = CheckpointDir(root, keep_last)
        self.root = self.dir.root

    def checkpoints(self) -> list[Path]:
        """Step directories under root, newest first (complete or not)."""
        return self.dir.checkpoints()

    def latest_complete(self) -> Path | None:
        """The newest checkpoint whose manifest verifies (rank-local, reads every file)."""
        return self.dir.latest_complete()

    # ---------------------------------------------------------------------------- save
    def save(
        self,
        step: int,
        parts: Mapping[str, Any],
        *,
        per_rank_parts: Mapping[str, Any] | None = None,
        config: dict | None = None,
        export_fn: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically and return its final directory (on every rank).

        ``parts``: name -> state (anything ``flatten_state`` takes), identical on every rank
        (replicated model/optimizer); taken from rank 0, ignored elsewhere. ``per_rank_parts``:
        name -> state that differs per rank (RNG); every rank's is gathered to rank 0 and
        stored as ``<name>_rank<r>``. ``config``: JSON-able dict saved as config.json.
        ``export_fn(tmp_dir)``: called on rank 0 only, before the manifest, to write extra
        files (e.g. ``tmp_dir / "export"``); they are covered by the manifest.

        Collective and a host sync: returns on every rank only after rank 0 has finished
        (so no rank runs ahead of a half-written checkpoint); the others wait for it host-side,
        up to train.pause_timeout_s (``distributed.host_barrier``), never on the collective
        timeout. On failure every rank raises CheckpointError naming the path; earlier
        checkpoints and ``latest`` are untouched.
        """
        if step < 0:
            raise ValueError(f"step={step} is invalid: use a non-negative step")
        names = list(parts) + list(per_rank_parts or {})
        for name in names:
            if not _PART_RE.match(name) or name in _RESERVED or re.search(r"_rank\d+$", name):
                raise ValueError(f"checkpoint part name {name!r} is invalid: use letters, digits, _ or - "
                                 f"(not {sorted(_RESERVED)} and not ending in _rank<N>)")
        if len(set(names)) != len(names):
            raise ValueError(f"checkpoint part names must be unique across parts and per_rank_parts: {names}")
        rank = distributed.get_rank()
        world = distributed.get_world_size()
        final = self.root / step_dir_name(step)

        # Per-rank states are serialised to file bytes on their own rank and shipped to rank 0
        # as plain bytes, so rank 0 writes exactly what the owner produced.
        payload = {n: _serialize_part(s) for n, s in (per_rank_parts or {}).items()}
        gathered = distributed.gather_object(payload, dst=0)

        error: str | None = None
        unexpected: Exception | None = None  # not an I/O failure: re-raised as itself on rank 0
        if rank == 0:
            started = time.monotonic()
            try:
                self.dir.write(step, final, parts, gathered or [payload], world, config, export_fn)
            except Exception as exc:  # reported to every rank below, then raised everywhere
                error = f"{type(exc).__name__}: {exc}"
                log.error("checkpoint save of step %d to %s failed: %s", step, final, error)
                if not isinstance(exc, OSError | CheckpointError):
                    unexpected = exc
            _warn_if_slow(time.monotonic() - started, final)
        # The end-of-save barrier: other ranks wait here until rank 0 has renamed the checkpoint
        # into place (or failed) -- host-side, under the pause clock: writing, hashing and exporting
        # GBs outlasts a step's collective. Then rank 0's outcome reaches every rank at once.
        distributed.host_barrier(f"rank 0's save of checkpoint step {step}", "pause")
        error = distributed.broadcast_object(error, src=0)
        if unexpected is not None:
            raise unexpected
        if error is not None:
            raise CheckpointError(f"could not save checkpoint step {step} to {final}: {error}. "
                                  "Previous checkpoints and 'latest' are unchanged; free disk space or fix "
                                  "permissions of the output directory.")
        return final

    # ---------------------------------------------------------------------------- load
    def load_latest(self, rank: int | None = None, verified: Path | None = None) -> Loaded | None:
        """Load the newest complete checkpoint, or return None when there is none.

        Collective: rank 0 removes stale temp dirs, verifies candidates newest first (sizes
        and sha256; corrupt or partial ones are skipped with a warning) and broadcasts its
        choice, so every rank loads the same step. ``rank`` (default: this process's rank)
        selects which per-rank parts are returned under their plain names (e.g. ``"rng"``).
        ``verified``: rank 0's ``latest_complete()`` found earlier (the others need not wait
        through the hashing here); None: verify now.
        """
        choice: str | None = None
        if distributed.get_rank() == 0:
            self.dir.remove_stale_tmp()
            found = verified if verified is not None else self.dir.latest_complete()
            choice = str(found) if found is not None else None
        choice = distributed.broadcast_object(choice, src=0)
        if choice is None:
            return None
        return self._load_verified(Path(choice), rank, shared=True)

    def load_shared(self, path: str | os.PathLike, rank: int | None = None, verdict: str | None = None) -> Loaded:
        """``load`` by every rank of the job at once (collective): rank 0 verifies ``path`` (or
        gives ``verdict``, its earlier verification: "" complete, else why not) and shares the
        verdict, so the others do not hash every file again; the replicated parts are then read
        once and broadcast (``_load_verified``)."""
        if distributed.get_rank() == 0 and verdict is None:
            verdict = self.verdict(path)
        verdict = distributed.broadcast_object(verdict, src=0)
        if verdict:
            raise CheckpointError(verdict)
        return self._load_verified(Path(path), rank, shared=True)

    @staticmethod
    def verdict(path: str | os.PathLike) -> str:
        """"" when the checkpoint in ``path`` is complete (sizes and sha256), else why not."""
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            return str(exc)
        return ""

    def load(self, path: str | os.PathLike, rank: int | None = None) -> Loaded:
        """Load the checkpoint in ``path`` after verifying it; CheckpointError if incomplete.

        Rank-local (no collective): each caller verifies and reads the files itself.
        """
        verify_checkpoint(path)
        return self._load_verified(Path(path), rank)

    def _load_verified(self, path: Path, rank: int | None, shared: bool = False) -> Loaded:
        """``shared`` (collective, every rank loads ``path``): the parts every rank shares are
        read once, by rank 0, and streamed to the others (host memory, under the start-up clock:
        ``_shared_parts``); each rank reads its own per-rank parts."""
        rank = distributed.get_rank() if rank is None else rank
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read the checkpoint on rank {rank} ({exc}); in a multi-node "
                                  "job the output directory must be on a filesystem shared by all nodes") from None
        parts = self._shared_parts(path, manifest) if shared and distributed.get_world_size() > 1 else None
        try:
            if parts is None:
                parts = {name: _read_part(path, name) for name in manifest["parts"]}
            saved_world = manifest["world_size"]
            for name in manifest["per_rank_parts"]:
                if rank < saved_world:
                    parts[name] = _read_part(path, f"{name}_rank{rank}")
                else:
                    log.warning("%s was saved by %d ranks; rank %d gets no %r part and must re-seed it",
                                path, saved_world, rank, name)
            # a run config saved before the sections were cut by owner, in today's sections
            config = upgrade_saved(json.loads((path / CONFIG).read_text())) if CONFIG in manifest["files"] else None
        except (OSError, ValueError, KeyError, safetensors.SafetensorError) as exc:
            raise CheckpointError(f"{path}: cannot load ({type(exc).__name__}: {exc})") from exc
        return Loaded(step=int(manifest["step"]), parts=parts, config=config, version=int(manifest["version"]))

    @staticmethod
    def _shared_parts(path: Path, manifest: dict) -> dict[str, Any]:
        """The replicated parts of ``path``: read by rank 0 alone (one read of shared storage
        per job instead of one per rank) and streamed to the others in bounded messages
        (``distributed.host_broadcast_bytes``), one part at a time. Host memory per rank: the
        parts' files' bytes once -- each part's tensors are views of the bytes received, nothing
        is pickled or copied on the way -- plus one part's JSON skeleton. A read error on rank 0
        is raised on every rank."""
        parts, rank0 = {}, distributed.get_rank() == 0
        for name in manifest["parts"]:
            data, head = None, None  # head: (the tensors file's size, its skeleton JSON), or why rank 0 could not
            if rank0:
                try:
                    data, skeleton = _read_part_files(path, name)
                    head = (len(data), skeleton)
                except OSError as exc:
                    head = f"{path}: cannot load on rank 0 ({type(exc).__name__}: {exc})"
            head = distributed.host_broadcast_object(head)
            if isinstance(head, str):
                raise CheckpointError(head)
            size, skeleton = head
            data = distributed.host_broadcast_bytes(data, size)
            try:
                parts[name] = _parse_part(data, skeleton)
            except (ValueError, KeyError, safetensors.SafetensorError) as exc:
                raise CheckpointError(f"{path}: cannot load ({type(exc).__name__}: {exc})") from exc
        return parts
