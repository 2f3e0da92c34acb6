"""Paths a command may write: one rule for ``prepare --out``, ``export --out`` and ``eval --output``.

A command that writes a file or replaces a directory checks its output path with
``check_output`` before any work:

1. never inside a training run's checkpoints (any run's, not only the one being read): a file
   written there fails that checkpoint's manifest check, and the run resumes from an older one;
2. never one of the command's own inputs, nor a directory that holds one, nor a path inside a
   model directory it reads (``eval --output`` onto its ``--prompts`` file or the target's
   ``config.json`` would destroy what it reads);
3. a directory that is replaced whole must be new, empty or of the kind the command writes
   (``kind``, tested by ``is_kind``): never a directory of other content.

Each refusal is one ``ValueError`` naming the flag, the path and what it would have damaged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from flashdraft.checkpoint import MANIFEST


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


def check_output(path: str | os.PathLike, *, flag: str, inputs: Iterable[str | os.PathLike] = (),
                 model_dirs: Iterable[str | os.PathLike] = (), kind: str = "",
                 is_kind: Callable[[Path], bool] | None = None) -> Path:
    """Refuse ``path`` (given as ``flag``) when the command may not write it (module doc).
    ``inputs``: the files and directories the command reads; ``model_dirs``: directories it reads
    whose every file matters (a target, a drafter), so nothing may be written inside them either.
    Returns the path, resolved."""
    out = Path(path).resolve()
    protected = checkpoints_around(out)
    if protected is not None:
        raise ValueError(f"{flag} {path} lies inside {protected}, a training run's checkpoints, which flashdraft "
                         "never writes into (it would damage a checkpoint the run resumes from); choose a path "
                         "outside it")
    model_dirs = [Path(d) for d in model_dirs if d]
    for given in [*inputs, *model_dirs]:
        source = Path(given).resolve()
        inside = Path(given) in model_dirs and out.is_relative_to(source)
        if out == source or inside or source.is_relative_to(out):
            what = "is" if out == source else "lies inside" if inside else "holds"
            raise ValueError(f"{flag} {path} {what} {given}, an input of this command, which writing there would "
                             "overwrite; choose another path")
    if kind and out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (is_kind and is_kind(out)))):
        raise ValueError(f"{flag} {path} exists and is not {kind}; give a new or empty directory, or {kind} "
                         "(which is replaced)")
    return out
