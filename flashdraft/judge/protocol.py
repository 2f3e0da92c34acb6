"""How flashdraft talks to a judge's worker, and what the judges share in their verdicts.

A worker is a script of flashdraft.judge.workers run with the engine environment's interpreter
(flashdraft.vllm_env): ``python WORKER REQUEST.json RESULT.json``, JSON in and out, in a temporary
directory and a session of its own (``run_worker``; the worker side is workers/protocol.py). The
verdicts both judges give count one side's steps the same way (``side``) and print it the same way
(``side_line``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from flashdraft.vllm_env import EngineUnavailable, is_flashdraft_build

WORKERS = Path(__file__).with_name("workers")  # the scripts that run under the engine's interpreter

def run_worker(python: Path, worker: Path, request: dict, *, what: str, env: dict, timeout: float) -> dict:
    """Run ``worker`` (a script of the engine environment: REQUEST.json RESULT.json) with
    ``python`` on ``request`` in a temporary directory of its own; its result. ``what`` names it
    in messages ("vLLM"). The worker runs in a session of its own: a SIGTERM or Ctrl-C to this
    process ends it and every process it started (vLLM starts some), removes the directory and
    raises on here (SIGTERM as ``Stopped``: the command ends with status 143); nothing is left
    behind. A worker that cannot start, fails or outlives ``timeout`` is ``EngineUnavailable``."""
    with tempfile.TemporaryDirectory(prefix=f"flashdraft-{what.lower()}-") as tmp:
        req, res, out = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
        req.write_text(json.dumps(request))
        with open(out, "w") as worker_log:
            try:
                proc = subprocess.Popen([str(python), str(worker), str(req), str(res)], env=env, cwd=tmp,
                                        stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:  # an interpreter deleted or made non-executable since it was checked
                fix = (f"delete {python.parent.parent} to have it rebuilt" if is_flashdraft_build(python) else
                       "name an interpreter that runs")
                raise EngineUnavailable(f"cannot start the {what} worker with {python} ({exc.strerror or exc}); "
                                        f"{fix}") from None
            try:
                with _signals_end(proc, what):
                    code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _end(proc)
                raise EngineUnavailable(f"{what} did not finish in {timeout:.0f} s") from None
            except BaseException:
                _end(proc)
                raise
        if code != 0 or not res.is_file():
            tail = "\n".join(out.read_text(errors="replace").strip().splitlines()[-10:])
            raise EngineUnavailable(f"the {what} worker exited with status {code}:\n{tail}")
        return json.loads(res.read_text())


@contextlib.contextmanager
def _signals_end(proc: subprocess.Popen, what: str):
    """While the block runs, SIGTERM raises ``Stopped`` here (whose handling ends the worker)
    instead of ending this process at once and orphaning it; Ctrl-C raises KeyboardInterrupt as
    always. Only the main thread can take signals: elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from flashdraft.signals import Stopped

    def stop(signum, frame):
        raise Stopped(signum, f"stopped by {signal.Signals(signum).name}: the {what} worker (pid {proc.pid}) was "
                              "ended and its files removed; nothing was written")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End the worker's whole session (it leads it: start_new_session): SIGTERM, then SIGKILL to
    whatever is left after ``grace_s``. The leader is reaped last: until then its id, which is the
    group's, cannot have been given to another process."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ChildProcessError):  # exited, not reaped (WNOWAIT): a zombie holds the id
        while time.monotonic() < deadline and os.waitid(os.P_PID, proc.pid,
                                                        os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the leader if it lingers, and its children
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()



def side(steps: list[list[int]], count: str = "steps") -> dict:
    """One side's figures from its accepted drafts per step of each prompt: tau per prompt and
    pooled, its steps (under the key ``count``) and accepted tokens."""
    from flashdraft.speculative import tau_per_prompt, tau_pooled

    return {"tau_pooled": tau_pooled(steps), "tau": tau_per_prompt(steps), count: sum(len(s) for s in steps),
            "accepted_tokens": sum(sum(s) for s in steps)}


def side_line(name: str, figures: dict, count: str = "steps") -> str:
    """One side's figures (``side``'s keys) as one line for a person."""
    return (f"{name}: tau pooled {figures['tau_pooled']:.3f} ({figures[count]} {count}, "
            f"{figures['accepted_tokens']} accepted)" + (f", per prompt {figures['tau']:.3f}" if figures.get("tau")
                                                          else ""))


def agreement(served: list[list[int]], plain, flashdraft_tokens: list[list[int]], steps: list[list[int]] | None,
              flashdraft_steps: list[list[int]]) -> dict:
    """How the judge's decode agrees: its outputs ``served`` with the target's plain greedy ``plain``
    (lossless; None where it did not decode plain) and with flashdraft's, and its accepted drafts
    per step with flashdraft's, prompt by prompt (the prompts that differ; not judged where the
    judge recorded no steps, ``steps`` None)."""
    found = {"lossless": served == plain if plain is not None else None, "same_outputs": served == flashdraft_tokens}
    if steps is None:
        return found
    differ = [i for i, (x, y) in enumerate(zip(steps, flashdraft_steps)) if x != y]
    return {**found, "same_steps": not differ and len(steps) == len(flashdraft_steps),
            "prompts_with_other_steps": differ}


def agreement_lines(report: dict, served: str, plain: str, differ_more: str = "") -> list[str]:
    """``agreement``'s verdict in a report as lines for a person; ``differ_more`` adds to the list
    of prompts whose steps differ."""
    lines = []
    if "lossless" in report:
        lines.append(f"lossless ({served} == {plain}): {report['lossless']}; {served} == flashdraft outputs: "
                     f"{report['same_outputs']}")
    if "same_steps" in report:
        lines.append(f"same acceptance at every step: {report['same_steps']}" + (
            "" if report["same_steps"] else f" (prompts {report['prompts_with_other_steps']} differ{differ_more})"))
    return lines
