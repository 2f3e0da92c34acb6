"""flashdraft.metrics: stage shares, ETA accuracy, sinks, formatting, progress display."""

from __future__ import annotations

import io
import json
import random
import sys
import time

import pytest
import torch

from flashdraft import metrics as M
from flashdraft.metrics import (
    JsonlSink,
    MetricsLogger,
    Progress,
    StageTimer,
    Throughput,
    format_duration,
    format_line,
    open_metrics,
    peak_memory_bytes,
)


def busy(seconds: float) -> None:
    """Sleep-free host work, so the timer sees real CPU time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_stage_shares_sum_to_the_measured_step_time_on_cpu():
    timer = StageTimer("cpu")
    num_steps = 5
    t0 = time.perf_counter()
    for _ in range(num_steps):
        with timer.stage("data"):
            time.sleep(0.004)
        with timer.stage("target"):
            busy(0.012)
        busy(0.003)  # unattributed host time -> "other"
        with timer.stage("drafter"):
            time.sleep(0.006)
        timer.step_done()
    wall_ms = (time.perf_counter() - t0) * 1e3
    s = timer.summary()
    assert s.num_steps == num_steps
    assert list(s.stage_ms) == ["data", "target", "drafter", "other"]
    assert sum(s.share.values()) == pytest.approx(1.0, abs=1e-9)
    assert sum(s.stage_ms.values()) == pytest.approx(s.step_ms, rel=1e-9)
    # Steps are timed from the first stage entry to the last step_done: the wall clock of the loop.
    assert s.step_ms * num_steps == pytest.approx(wall_ms, rel=0.10)
    assert s.stage_ms["target"] >= 12.0 and s.stage_ms["data"] >= 4.0 and s.stage_ms["drafter"] >= 6.0
    assert s.stage_ms["other"] >= 2.5
    m = s.as_metrics()
    assert m["time/step_ms"] == s.step_ms and m["time/target_share"] == s.share["target"]
    assert timer.summary().num_steps == 0  # summary consumes the window


def test_stage_timer_attributes_gaps_between_steps_to_other_and_keeps_open_step():
    timer = StageTimer("cpu")
    with timer.stage("a"):
        busy(0.002)
    timer.step_done()
    busy(0.004)  # between steps: belongs to step 2's "other"
    with timer.stage("a"):
        busy(0.002)
    timer.step_done()
    with timer.stage("a"):  # step 3 still open at summary time: reported next time
        pass
    s = timer.summary()
    assert s.num_steps == 2 and s.stage_ms["other"] >= 1.5
    timer.step_done()
    assert timer.summary().num_steps == 1


def test_stage_timer_empty_summary():
    s = StageTimer().summary()
    assert s.num_steps == 0 and s.step_ms == 0 and s.share == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stage_timer_cuda_events():  # pragma: no cover - runs on GPU machines only
    timer = StageTimer("cuda")
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        with timer.stage("matmul"):
            for _ in range(10):
                x = (x @ x).tanh()
        timer.step_done()
    s = timer.summary()
    assert s.num_steps == 3 and s.stage_ms["matmul"] > 0 and sum(s.share.values()) == pytest.approx(1.0)


def test_eta_is_within_20_percent_on_a_steady_synthetic_loop():
    rnd = random.Random(0)
    total, now, step = 1000, 0.0, 0
    durations = [1.3 * rnd.uniform(0.8, 1.2) for _ in range(total)]  # noisy but steady rate
    tp = Throughput(window=50)
    tp.update(0, 0, now=now)
    for i, d in enumerate(durations):
        now += d
        step = i + 1
        tp.update(step, tokens=4096, now=now)
        if step in (20, 100, 500, 900):
            truth = sum(durations[step:])
            assert tp.eta_s(total) == pytest.approx(truth, rel=0.20), step
    assert tp.tokens_per_s == pytest.approx(4096 / 1.3, rel=0.2)
    assert tp.s_per_step == pytest.approx(1.3, rel=0.2)
    assert tp.eta_s(total) == 0


def test_eta_follows_a_speed_change_and_needs_two_updates():
    tp = Throughput(window=10)
    assert tp.eta_s(100) is None and tp.steps_per_s is None
    tp.update(0, now=0.0)
    for s in range(1, 31):  # 1 s/step, then 0.5 s/step after a warm-up
        tp.update(s, now=float(s) if s <= 10 else 10 + 0.5 * (s - 10))
    assert tp.s_per_step == pytest.approx(0.5)
    assert tp.eta_s(100) == pytest.approx(35.0)
    with pytest.raises(ValueError):
        Throughput(window=0)


def test_jsonl_sink_writes_one_flushed_object_per_line(tmp_path):
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    sink.log(10, {"loss": 2.5, "acc": 0.4, "lr": 1e-4, "note": "warmup"})
    # Flushed: readable before close, as a crash would leave it.
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 10 and first["loss"] == 2.5 and first["note"] == "warmup" and "time" in first
    # An eval with no draft step at all (every prompt ended at once) has NaN acceptances.
    sink.log(20, {"loss": float("nan"), "grad_norm": float("inf"), "eval_acceptance": [float("nan"), 0.5]})
    sink.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    second = json.loads(lines[1])  # strict JSON even for a diverged loss
    assert second["loss"] == "nan" and second["grad_norm"] == "inf" and second["eval_acceptance"] == ["nan", 0.5]
    sink2 = JsonlSink(tmp_path / "run" / "metrics.jsonl")  # resumed run appends
    sink2.log(30, {"loss": 1.0})
    sink2.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [10, 20, 30]


def test_a_resume_that_cannot_rewind_metrics_jsonl_warns_and_still_logs(tmp_path, monkeypatch, caplog):
    # The rewrite of metrics.jsonl at a resume fails (a full disk at its rename): the run must not
    # fail for it, nor leave the temporary file behind.
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(M.os, "replace", disk_full)
    sink = JsonlSink(path, start_step=2)
    monkeypatch.undo()
    sink.log(3, {"loss": 0.5})
    sink.close()
    assert "could not move the records after step 2 aside" in caplog.text
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.abandoned.jsonl", "metrics.jsonl"]


def test_open_metrics_writes_on_main_rank_only_and_converts_tensors(tmp_path):
    with open_metrics(tmp_path / "main", is_main=True) as logger:
        logger.log(1, {"loss": torch.tensor(2.0), "acc": torch.tensor([0.5])[0], "tokens": 128})
    rec = json.loads((tmp_path / "main" / "metrics.jsonl").read_text())
    assert rec["loss"] == 2.0 and rec["acc"] == 0.5 and rec["tokens"] == 128
    with open_metrics(tmp_path / "other", is_main=False) as logger:
        logger.log(1, {"loss": 2.0})
    assert not (tmp_path / "other").exists()
    with open_metrics(tmp_path / "default") as logger:  # no process group: this is rank 0
        logger.log(1, {"loss": 2.0})
    assert (tmp_path / "default" / "metrics.jsonl").is_file()


def test_optional_backends_give_clear_errors_when_missing(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown"):
        open_metrics(tmp_path, ("jsonl", "mlflow"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail, installed or not
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"'wandb' is not installed: pip install 'flashdraft\[wandb\]'"):
        open_metrics(tmp_path, ("jsonl", "wandb"), is_main=False)  # checked on every rank
    with pytest.raises(RuntimeError, match=r"pip install 'flashdraft\[tensorboard\]'"):
        M.TensorBoardSink(tmp_path / "tb")


def test_format_line_matches_the_documented_shape():
    line = format_line(
        120, 6000, {"loss": 2.3104, "acc": 0.4129, "tau~": 3.14},
        tokens_per_s=5234.0, s_per_step=1.312, eta_s=2 * 3600 + 8 * 60 + 10,
        shares={"data": 0.02, "h2d": 0.01, "target": 0.61, "drafter": 0.2, "backward": 0.12, "sync": 0.03,
                "optim": 0.01},
    )
    assert line == ("step 120/6000 loss 2.31 acc 0.413 tau~3.14 | 5.2k tok/s 1.31 s/step ETA 2h08m | "
                    "data 2% h2d 1% target 61% drafter 20% backward 12% sync 3% optim 1%")
    assert format_line(5) == "step 5"
    assert format_line(5, None, {"loss": float("nan"), "lr": 3e-5, "n": 7}, peak_mem_bytes=3 << 30) == \
        "step 5 loss nan lr 3.00e-05 n 7 | mem 3.0G"


@pytest.mark.parametrize(("seconds", "text"), [(None, "?"), (float("inf"), "?"), (0.4, "0s"), (45, "45s"),
                                               (725, "12m05s"), (7690, "2h08m"), (22.9 * 86400, "22d21h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_peak_memory_is_positive_on_cpu():
    assert peak_memory_bytes("cpu") > 10 * (1 << 20)  # a Python process with torch uses > 10 MiB


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(100, stream=out)
    assert not p.interactive
    p.update(10)
    p.write("step 10/100 loss 2.0")
    p.close()
    assert out.getvalue() == "step 10/100 loss 2.0\n"
    quiet = io.StringIO()
    q = Progress(100, stream=quiet, enabled=False, interactive=True)
    q.write("x")
    q.close()
    assert quiet.getvalue() == ""


def test_progress_uses_tqdm_on_a_terminal():
    out = _Tty()
    p = Progress(100, initial=5, stream=out)
    assert p.interactive
    p.update(50)
    p.write("step 50/100 loss 1.0")
    p.close()
    text = out.getvalue()
    assert "step 50/100 loss 1.0" in text and "50/100" in text and "%" in text


def test_metrics_logger_disabled_is_a_no_op():
    class Boom:
        def log(self, step, metrics):
            raise AssertionError("must not be called")

        def close(self):
            raise AssertionError("must not be called")

    logger = MetricsLogger([Boom()], enabled=False)
    logger.log(1, {"a": 1})
    logger.close()


def test_owner_only_timer_ignores_other_threads_so_the_breakdown_sums_to_the_step():
    import threading
    import time as _time

    from flashdraft.metrics import StageTimer

    timer = StageTimer("cpu", owner_only=True)

    def elsewhere():
        with timer.stage("target"):
            _time.sleep(0.05)

    worker = threading.Thread(target=elsewhere)
    with timer.stage("drafter"):
        worker.start()
        _time.sleep(0.02)
    worker.join()
    with timer.stage("optim"):
        _time.sleep(0.01)
    timer.step_done()
    summary = timer.summary()
    assert "target" not in summary.stage_ms
    assert abs(sum(summary.stage_ms.values()) - summary.step_ms) < 1e-6
    assert summary.stage_ms["drafter"] >= 20
