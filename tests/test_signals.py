"""One signal contract for every command that trains: the first SIGTERM / SIGINT finishes the
step, saves, and ends the whole command with 128 + signal and a line naming what was saved; a
second one ends it at once. The quickstart goes on from its saved step when run again."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import overrides, read_log
from flashdraft.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow  # each test runs whole commands in their own processes


def _start(server, args: list[str], tmp_path: Path, pace: float) -> tuple[int, Path]:
    """``flashdraft ARGS`` as the console script runs it (tests/_workers.py cli, forked from the
    session's fork server), each optimizer step paced by ``pace`` seconds; HOME in tmp_path, so the
    quickstart's target cache is the test's own. Returns (pid, log)."""
    return server.spawn("cli", *map(str, args), env={"HOME": str(tmp_path / "home"),
                                                     "FLASHDRAFT_TEST_STEP_SLEEP": str(pace)})


def _wait_for(log: Path, text: str, server, pid: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in read_log(log):
        if server.exits.get(pid) is not None or time.monotonic() > deadline:
            server.kill(pid)
            pytest.fail(f"no {text!r} (exit {server.exits.get(pid)}):\n{read_log(log)[-3000:]}")
        time.sleep(0.05)


def _stop(server, pid: int, *signals: int, gap: float = 0.0) -> tuple[int, float]:
    """Send ``signals`` (``gap`` seconds apart); the exit status and the seconds it took to exit."""
    start = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(gap)
        os.kill(pid, sig)
    code = server.wait(pid, 120)
    return code, time.monotonic() - start


def test_sigterm_ends_the_quickstart_with_143_and_running_it_again_resumes(tmp_path, forkserver):
    out = tmp_path / "qs"
    pid, log = _start(forkserver, ["quickstart", "--smoke", "--output", out], tmp_path, pace=1.0)
    _wait_for(log, "[5/7] drafter", forkserver, pid)
    _wait_for(log, "[paced] optimizer step done", forkserver, pid)
    code, took = _stop(forkserver, pid, signal.SIGTERM)
    text = read_log(log)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    found = re.search(r"flashdraft quickstart: stopped by SIGTERM at step (\d+) of 12: checkpoint (\S+) saved; run "
                      r"the same command again to resume from it", text)
    assert found, text[-3000:]
    step = int(found[1])
    assert Path(found[2]) == out / "run" / "checkpoints" / f"step_{step:08d}"
    assert CheckpointManager(out / "run" / "checkpoints").load_latest().step == step < 12
    assert took < 20, took  # the step in flight (+1 s of pacing), the save, the exit
    assert not (out / "eval" / "report.json").exists()

    pid, again = _start(forkserver, ["quickstart", "--smoke", "--output", out], tmp_path, pace=0)
    assert forkserver.wait(pid, 600) == 0, read_log(again)[-3000:]
    text = read_log(again)
    assert f"a stopped drafter run of these settings; going on from step_{step:08d}" in text
    assert f"resumed from step {step}" in text
    assert (out / "eval" / "report.json").is_file() and (out / "drafter" / "model.safetensors").is_file()

    # other settings (or a finished run): the drafter stage starts over
    pid, other = _start(forkserver, ["quickstart", "--smoke", "--output", out, "--seed", "1"], tmp_path, pace=0)
    assert forkserver.wait(pid, 600) == 0, read_log(other)[-3000:]
    text = read_log(other)
    assert "a run of other settings; the drafter stage starts over" in text and "resumed from step" not in text


def test_sigterm_ends_a_benchmark_with_143_within_a_step(tmp_path, forkserver):
    pid, log = _start(forkserver, ["bench", "pipeline", "--work", "", "--repeats", "2", "--real-steps", "30",
                                   "--threads", "1"], tmp_path, pace=1.0)
    _wait_for(log, "[paced] optimizer step done", forkserver, pid)
    code, took = _stop(forkserver, pid, signal.SIGTERM)
    text = read_log(log)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert "flashdraft bench: stopped by SIGTERM: the benchmark ended there" in text
    assert took < 20, took
    assert text.count("[paced] optimizer step done") < 30  # its first run did not go on, nor the next ones


def test_a_second_signal_ends_the_run_at_once(tiny_job, tmp_path, forkserver):
    out = tmp_path / "run"
    args = overrides(tiny_job, out, train__max_steps=12, checkpoint__save_every=1)
    pid, log = _start(forkserver, ["train", *args], tmp_path, pace=5.0)
    _wait_for(log, "[paced] optimizer step done", forkserver, pid)
    code, took = _stop(forkserver, pid, signal.SIGTERM, signal.SIGINT, gap=1.5)
    text = read_log(log)
    assert code == -signal.SIGINT, text[-3000:]  # ended by the second signal itself, mid-step
    assert took < 4, took  # not after the 5 s step
    assert "received SIGINT again: exiting now" in text
    loaded = CheckpointManager(out / "checkpoints").load_latest()
    assert loaded is None or loaded.step <= 1  # what was saved before stays whole


def test_the_same_signal_delivered_twice_at_once_is_one_request(tiny_job, tmp_path, forkserver):
    """torchrun forwards a terminal's Ctrl-C (or SLURM's signal) its workers also got directly:
    two copies milliseconds apart must not count as the "exit at once" second signal."""
    out = tmp_path / "run"
    pid, log = _start(forkserver, ["train", *overrides(tiny_job, out, train__max_steps=12)], tmp_path, pace=1.0)
    _wait_for(log, "[paced] optimizer step done", forkserver, pid)
    code, _ = _stop(forkserver, pid, signal.SIGINT, signal.SIGINT, gap=0.05)
    text = read_log(log)
    assert code == 128 + signal.SIGINT, text[-3000:]
    assert "flashdraft train: stopped by SIGINT at step" in text and "exiting now" not in text


def test_a_stop_passed_on_from_a_peer_never_ends_the_process():
    # A drafter rank that got SIGTERM itself and is still saving when its target rank's copy of
    # the same request arrives (seconds later) must keep stopping gracefully: only a signal sent
    # to the process twice ends it at once.
    from flashdraft.train.runtime import GracefulStop

    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.signum == signal.SIGTERM
        stop._first_at -= 10 * GracefulStop.REPEAT_AFTER_S  # the save took long
        stop.request(signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
    with GracefulStop() as stop:  # not yet stopping: the peer's request is this rank's request
        stop.request(signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT
