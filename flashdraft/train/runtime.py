"""The training process's runtime: what a run holds for its whole life besides the model.

- :func:`output_lock`: one run per ``train.output_dir`` (an flock, released by the kernel
  whatever way the process ends).
- :class:`GracefulStop`: SIGTERM / SIGINT ask the loop to stop at the end of the step; a
  second one ends the process at once. :class:`flashdraft.signals.Stopped` then ends the whole command.
- :func:`keep_freed_host_memory`: glibc keeps freed activations for reuse (CPU training).
- :class:`ProcessRNG`: the torch / numpy / python (/ CUDA) generators as one checkpointable
  component.
- :func:`deterministic_mode`: train.deterministic, with the cuBLAS workspace CUDA needs for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


@contextlib.contextmanager
def output_lock(output: Path):
    """Hold an exclusive lock on OUTPUT/.lock while a run trains there: a second run on the same
    train.output_dir fails at once instead of interleaving its checkpoints and metrics with the
    first one's. Released by the kernel whatever way the process ends (flock), so a crash never
    leaves a stale lock."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        if (output / "checkpoints").exists() and not (output / "checkpoints").is_dir():
            raise NotADirectoryError(f"{output / 'checkpoints'} is a file")
        lock = open(output / ".lock", "a+")
    except OSError as exc:
        raise ValueError(f"train.output_dir {output}: cannot use it for the run's outputs ({exc.strerror or exc}); "
                         "give a writable directory (not a file)") from None
    with lock as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ValueError(f"{output}: another flashdraft run ({f.read().strip() or 'unknown process'}) is training "
                             "in this train.output_dir; wait for it to end, or use another directory") from None
        except OSError as exc:  # a file system without flock: run unlocked rather than not at all
            log.warning("%s: cannot lock the output directory (%s); make sure no other run uses it", output, exc)
            yield
            return
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield


class GracefulStop:
    """The first SIGTERM / SIGINT sets ``signum``: the loop finishes its step, checkpoints and
    raises :class:`Stopped`. A second one, a second or more later, ends the process at once, as
    that signal does by default (exit status 128 + signal; a checkpoint being written is never
    torn: saves are atomic). Installed only on the main thread (Python delivers signals there)."""

    # A second signal this soon after the first is the same request delivered twice (torchrun
    # forwards the terminal's Ctrl-C, or SLURM's signal, that its workers also got directly).
    REPEAT_AFTER_S = 1.0

    def __init__(self):
        self.signum = 0
        self._first_at = 0.0
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum != 0

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if time.monotonic() - self._first_at < self.REPEAT_AFTER_S:
                return  # the first request again, forwarded
            log.warning("received %s again: exiting now", signal.Signals(signum).name)  # a second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.request(signum, "received")

    def request(self, signum: int, how: str = "forwarded") -> None:
        """Ask for the stop ``signum`` would ask for (a peer rank's signal, passed on): never
        the "second signal" that ends the process, whenever it comes."""
        if self.requested:
            return
        self.signum, self._first_at = signum, time.monotonic()
        log.warning("%s %s: finishing this step, then checkpointing (send it again to exit at once)",
                    how, signal.Signals(signum).name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

    A training step frees and re-allocates the same multi-MB activations every step. By default
    glibc unmaps large freed blocks at once and trims the heap's top, so the next step
    page-faults them back in: 3-18 thousand faults per drafter step of the bench point, ~8 %
    of the CPU trainer's steps/s (docs/benchmarks.md). This is the host-side counterpart of
    CUDA's caching allocator, for CPU training (``train.keep_freed_host_memory``). It is
    process-wide and stays for the process's life: resident memory stays at its peak instead
    of shrinking between steps. Blocks up to 1 GiB are kept (glibc <= 2.34 accepts at most
    32 MiB; then that). Skipped where the user set glibc's own malloc tunables
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, glibc.malloc.* in GLIBC_TUNABLES), and off
    glibc. Returns whether it took effect."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    kept = mallopt(m_trim_threshold, 2**31 - 1)
    return bool(kept and (mallopt(m_mmap_threshold, 1 << 30) or mallopt(m_mmap_threshold, 32 << 20)))


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace (its docs: :4096:8 or :16:8)


def deterministic_mode() -> None:
    """train.deterministic: torch's deterministic algorithms, and CUBLAS_WORKSPACE_CONFIG set first
    (without it every CUDA matmul raises under them). cuBLAS reads the variable when it makes its
    workspace, so this runs before the trainer touches CUDA; a value already in the environment
    is kept. What stays non-deterministic is in docs/reliability.md."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("train.deterministic: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set; if cuBLAS "
                    "then raises, export CUBLAS_WORKSPACE_CONFIG=%s before starting", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)


class ProcessRNG:
    """This process's random generators (torch, numpy, python and, where present, CUDA) as a
    checkpoint component. Per rank: each rank saves and restores its own."""

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
