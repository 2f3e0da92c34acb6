"""Paths a command may write, and how a report is written: one rule for ``prepare --out``,
``export --out``, ``eval --output`` and the benchmarks' reports.

A command that writes a file or replaces a directory checks its output path with
``check_output`` before any work:

1. never inside a training run's checkpoints (any run's, not only the one being read): a file
   written there fails that checkpoint's manifest check, and the run resumes from an older one;
   nor one of a training run's own outputs (``RUN_OUTPUTS``: its export ``drafter/``, its
   ``metrics.jsonl``, its ``config.yaml``, ...), in whatever run directory it lies;
2. never one of the command's own inputs, nor a directory that holds one, nor a path inside a
   model directory it reads (``eval --output`` onto its ``--prompts`` file or the target's
   ``config.json`` would destroy what it reads), whether named as given, through a symbolic link
   or as a hard link: an existing output is compared by (st_dev, st_ino) with every file of the
   inputs and model directories (a Hugging Face cache's ``snapshots/REV/config.json`` is a link
   to ``blobs/SHA``);
3. a directory that is replaced whole must be new, empty or of the kind the command writes
   (``kind``, tested by ``is_kind``): never a directory of other content, nor a symbolic link
   (replacing it would put a directory where the link was, and leave its target behind).

A report (``write_report``) is never written into an existing file in place: it goes to a new
temporary file beside the output (``tempfile.mkstemp``: created, never followed) and is renamed
onto it, so a link or hard link there is replaced, never written through, and a reader never
sees half a report. ``check_report`` refuses, up front, what a rename cannot replace: a
directory, a block device, a socket, a symbolic link to a file. A named pipe or a character
device (``/dev/null``, a terminal) holds no file to damage and is written directly, once, at the
end: a pipe's reader then gets the whole report (opening it to probe at the start would end the
reader's input before the report exists).

Each refusal is one ``ValueError`` naming the flag, the path and what it would have damaged.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from flashdraft.checkpoint import MANIFEST, follow_umask

# What a training run writes into its train.output_dir (besides checkpoints/), by name: its
# serving export, its logs (the TensorBoard and W&B sinks' directories too), its resolved
# config and its lock.
RUN_OUTPUTS = ("checkpoints", "drafter", "metrics.jsonl", "metrics.abandoned.jsonl", "config.yaml", ".lock",
               "tensorboard", "wandb")


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint, wherever it was copied to: a manifest.json that names its step (exports have none)."""
    try:
        return "step" in json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _is_checkpoints_dir(path: Path) -> bool:
    """A run's checkpoints directory (a ``step_*`` checkpoint in it), or one checkpoint."""
    if _is_checkpoint(path):
        return True
    try:
        return any(p.name.startswith("step_") and _is_checkpoint(p) for p in path.iterdir())
    except OSError:
        return False


def checkpoints_around(path: Path) -> Path | None:
    """The checkpoints directory (or lone checkpoint) that ``path`` lies in or is, if any: the
    outermost one, so that a message names a run's whole checkpoints directory."""
    found = [parent for parent in [path, *path.parents] if parent.is_dir() and _is_checkpoints_dir(parent)]
    return found[-1] if found else None


def is_run_dir(path: Path) -> bool:
    """A training run's directory (train.output_dir): its resolved config.yaml beside its lock,
    its metrics or its checkpoints (every run writes config.yaml and .lock at its start)."""
    try:
        return (path / "config.yaml").is_file() and any(
            (path / name).exists() for name in (".lock", "metrics.jsonl", "checkpoints"))
    except OSError:
        return False


def run_output_around(path: Path) -> Path | None:
    """The training run's own output (RUN_OUTPUTS: its export, logs, config, lock) that ``path``
    is or lies inside, if any."""
    for parent in path.parents:
        if is_run_dir(parent):
            own = parent / path.relative_to(parent).parts[0]
            if own.name in RUN_OUTPUTS:
                return own
    return None


def _given(path: Path) -> Path:
    """``path`` absolute with its directory resolved and its last component as given: a link
    there stays the link (``Path.resolve`` would name what it points at)."""
    path = Path(os.path.abspath(path))
    return path.parent.resolve() / path.name


def _file_ids(sources: Iterable[Path]) -> dict[tuple[int, int], Path]:
    """(st_dev, st_ino) -> path of every file the sources are or hold (links followed: a link in
    a model directory counts as the file it names)."""
    ids: dict[tuple[int, int], Path] = {}
    for source in sources:
        walked = os.walk(source, followlinks=False) if source.is_dir() else [(str(source.parent), [], [source.name])]
        for root, _, files in walked:
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.stat(Path(root) / name)
                    ids.setdefault((st.st_dev, st.st_ino), Path(root) / name)
    return ids


def check_output(path: str | os.PathLike, *, flag: str, inputs: Iterable[str | os.PathLike] = (),
                 model_dirs: Iterable[str | os.PathLike] = (), kind: str = "",
                 is_kind: Callable[[Path], bool] | None = None) -> Path:
    """Refuse ``path`` (given as ``flag``) when the command may not write it (module doc).
    ``inputs``: the files and directories the command reads; ``model_dirs``: directories it reads
    whose every file matters (a target, a drafter), so nothing may be written inside them either.
    Returns the path, resolved."""
    given, out = _given(Path(path)), Path(path).resolve()
    for where in (given, out):
        protected = checkpoints_around(where)
        if protected is not None:
            raise ValueError(f"{flag} {path} lies inside {protected}, a training run's checkpoints, which flashdraft "
                             "never writes into (it would damage a checkpoint the run resumes from); choose a path "
                             "outside it")
        own = run_output_around(where)
        if own is not None:
            raise ValueError(f"{flag} {path} {'is' if where == own else 'lies inside'} {own}, an output of the "
                             f"training run in {own.parent} (its {own.name}), which only that run writes; choose a "
                             "path outside it")
    model_dirs = [Path(d) for d in model_dirs if d]
    sources = [Path(given_source) for given_source in [*inputs, *model_dirs] if given_source]
    for source_given in sources:
        source = source_given.resolve()
        for where in (given, out):
            inside = source_given in model_dirs and where.is_relative_to(source)
            if where == source or inside or source.is_relative_to(where):
                what = "is" if where == source else "lies inside" if inside else "holds"
                raise ValueError(f"{flag} {path} {what} {source_given}, an input of this command, which writing "
                                 "there would overwrite; choose another path")
    if out.is_file():  # the same file under another name: a hard link, or a link from elsewhere into a model
        st = out.stat()
        same = _file_ids(sources).get((st.st_dev, st.st_ino))
        if same is not None:
            raise ValueError(f"{flag} {path} is the file {same} (a {'symbolic' if given.is_symlink() else 'hard'} "
                             "link of it), an input of this command, which writing there would overwrite; choose "
                             "another path")
    if kind and given.is_symlink():
        raise ValueError(f"{flag} {path} is a symbolic link (to {os.readlink(given)}); give the directory itself: "
                         f"flashdraft replaces {kind} whole, which would put a new directory where the link is")
    if kind and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (is_kind and is_kind(out)))):
        raise ValueError(f"{flag} {path} exists and is not {kind}; give a new or empty directory, or {kind} "
                         "(which is replaced)")
    return out


def check_report(path: str | os.PathLike, *, flag: str, inputs: Iterable[str | os.PathLike] = (),
                 model_dirs: Iterable[str | os.PathLike] = ()) -> Path:
    """``check_output`` for a report file, and what ``write_report`` cannot write (module doc):
    refused, up front, before the command's work. Creates the report's directory. Returns the
    path as given (absolute)."""
    check_output(path, flag=flag, inputs=inputs, model_dirs=model_dirs)
    given = Path(os.path.abspath(path))
    try:
        mode = os.stat(given).st_mode
    except FileNotFoundError:
        mode = None  # new (or a dangling link: refused below)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write the report there ({exc.strerror or exc}); choose a writable "
                         "path") from None
    if stat.S_ISFIFO(mode or 0) or stat.S_ISCHR(mode or 0):
        return given  # written directly at the end (module doc)
    if mode is not None and not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
        raise ValueError(f"{flag} {path} is {what}, not a file; give the path of a file to write the report to")
    if given.is_symlink():
        raise ValueError(f"{flag} {path} is a symbolic link (to {os.readlink(given)}): a report is written beside it "
                         "and renamed into place, never through a link; give the file itself")
    try:
        given.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=given.parent, prefix=f".{given.name}.", delete=True)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write the report there ({exc.strerror or exc}); choose a writable "
                         "path") from None
    probe.close()
    return given


def write_report(path: str | os.PathLike, text: str, *, flag: str) -> None:
    """Write ``text`` to ``path`` as ``check_report`` allows: a named pipe or a character device
    directly; anything else into a new temporary file beside it (its mode as the umask gives),
    flushed to disk, then renamed onto it. ValueError naming ``flag`` when the write fails (a
    full disk): an earlier file at ``path`` is then left as it was and no temporary file stays."""
    given = Path(os.path.abspath(path))
    try:
        try:
            mode = os.stat(given).st_mode
        except FileNotFoundError:
            mode = 0
        if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):  # holds no file: written directly
            with open(given, "w", encoding="utf-8") as f:
                f.write(text)
            return
        given.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=given.parent, prefix=f".{given.name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            follow_umask(tmp)
            os.replace(tmp, given)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write the report ({exc.strerror or exc})") from None
