"""The pipeline engine: channels, cancellation, failures from every stage, no leaked threads,
and the pipelined trainer's equivalence with the sequential one."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import pytest
import torch

from conftest import overrides
from flashdraft.checkpoint import CheckpointManager
from flashdraft.config import load_config
from flashdraft.feed.flow import BufferPool, Cancelled, Channel, ChannelClosed, Pipeline, Stage, thread_device
from flashdraft.feed.stages import FeatureStages
from flashdraft.metrics import EventMeter, MeterTotals, StageTimer
from flashdraft.signals import Stopped
from flashdraft.train.trainer import Trainer


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("flashdraft-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    deadline = time.monotonic() + 2
    while pipeline_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline_threads() == []


# ---- channels ------------------------------------------------------------------------------


def test_channel_is_bounded_fifo_and_close_drains():
    ch = Channel(2)
    ch.put(1)
    ch.put(2)
    blocked = threading.Event()

    def producer():
        blocked.set()
        ch.put(3)  # blocks until a get

    t = threading.Thread(target=producer)
    t.start()
    blocked.wait()
    time.sleep(0.05)
    assert len(ch) == 2 and t.is_alive()
    assert ch.get() == 1
    t.join(2)
    assert not t.is_alive() and ch.put_wait_s > 0
    ch.close()
    assert [ch.get(), ch.get()] == [2, 3]
    with pytest.raises(ChannelClosed):
        ch.get()
    with pytest.raises(ChannelClosed):
        ch.put(4)


@pytest.mark.parametrize("side", ["put", "get"])
def test_cancel_wakes_a_blocked_producer_or_consumer(side):
    ch = Channel(1)
    if side == "put":
        ch.put(0)  # full: the next put blocks (a full channel whose consumer is dead)
    raised = []

    def waiter():
        try:
            ch.put(1) if side == "put" else ch.get()
        except Cancelled:
            raised.append(True)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    ch.cancel()
    t.join(2)
    assert not t.is_alive() and raised == [True] and time.monotonic() - t0 < 1


# ---- the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("threaded", [True, False])
def test_items_flow_in_order_through_every_stage(threaded):
    stages = [Stage("double", lambda x: 2 * x), Stage("inc", lambda x: x + 1)]
    with Pipeline(range(50), stages, capacity=2, threaded=threaded) as pipe:
        out = list(pipe)
    assert out == [2 * i + 1 for i in range(50)]
    report = pipe.report()
    assert [s.name for s in report.stages] == ["data", "double", "inc", "drafter"]
    assert report.items == 50


def _source_fails():
    yield 1
    raise KeyError("bad sample 7")


def _stage_fails(x):
    if x == 3:
        raise ValueError("target exploded on item 3")
    return x


@pytest.mark.parametrize("where", ["source", "stage"])
def test_a_failing_stage_reaches_the_consumer_with_its_traceback(where):
    source = _source_fails() if where == "source" else iter(range(100))
    expected = KeyError if where == "source" else ValueError
    pipe = Pipeline(source, [Stage("target", _stage_fails)], capacity=2)
    t0 = time.monotonic()
    with pytest.raises(expected) as info:
        with pipe:
            for _ in pipe:
                pass
    assert time.monotonic() - t0 < 2
    text = "".join(traceback.format_exception(info.value))
    assert ("_source_fails" if where == "source" else "_stage_fails") in text  # the stage's own frames
    assert "raised in pipeline stage" in text
    assert pipe.alive_threads() == []


class _NoNotes(Exception):
    """An exception without add_note, as every exception is on Python 3.10."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_failing_stage_reaches_the_consumer_on_python_3_10_too():
    """Python 3.10 has no add_note: the failure must still cancel the pipeline and reach the
    consumer (an AttributeError inside the handler once left the consumer waiting forever)."""
    def fails(x):
        raise _NoNotes("target exploded")

    pipe = Pipeline(iter(range(100)), [Stage("target", fails)], capacity=2)
    caught = []

    def consume():
        try:
            with pipe:
                for _ in pipe:
                    pass
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the consumer hangs"
    assert len(caught) == 1 and isinstance(caught[0], _NoNotes)


def test_consumer_failure_or_early_exit_does_not_hang_blocked_producers():
    produced = []

    def source():
        for i in range(10_000):
            produced.append(i)
            yield i

    pipe = Pipeline(source(), [Stage("target", lambda x: x)], capacity=1, join_timeout_s=2)
    with pytest.raises(RuntimeError, match="drafter died"):
        with pipe:
            for _item in pipe:
                time.sleep(0.1)  # let every producer fill its channel and block
                raise RuntimeError("drafter died")
    assert pipe.alive_threads() == []
    assert len(produced) < 10  # bounded read-ahead, not the whole source


def test_buffer_pool_blocks_until_release_and_cancels():
    pool = BufferPool(["a"])
    assert pool.acquire() == "a"
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire()))
    t.start()
    time.sleep(0.05)
    assert got == []
    pool.release("a")
    t.join(2)
    assert got == ["a"]
    t = threading.Thread(target=lambda: pytest.raises(Cancelled, pool.acquire))
    t.start()
    pool.cancel()
    t.join(2)
    assert not t.is_alive()
    pool.release("a")  # after cancel: silently ignored, never masks the real error


def test_synthetic_stages_overlap_and_the_report_names_the_bound():
    """Sleep-based stages. Threaded, the target stage works while the consumer does (their busy
    intervals overlap); inline, never. Intervals, not wall times: a loaded machine stretches both
    runs, but cannot make inline stages overlap or threaded ones take turns for 20 items."""
    def overlapping(a, b):
        return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)

    def source(n, ms):
        for i in range(n):
            time.sleep(ms / 1e3)
            yield i

    for threaded in (False, True):
        target, consumer = [], []

        def work(x, spans=target):
            begin = time.perf_counter()
            time.sleep(0.03)
            spans.append((begin, time.perf_counter()))
            return x

        with Pipeline(source(20, 10), [Stage("target", work)], capacity=2, threaded=threaded) as pipe:
            for _ in pipe:
                begin = time.perf_counter()
                time.sleep(0.02)
                consumer.append((begin, time.perf_counter()))
        report = pipe.report()
        assert report.bound == "target-bound"
        assert report.slowest.busy_ms_per_item >= 29
        assert len(target) == len(consumer) == 20
        assert overlapping(target, consumer) == threaded, (threaded, target[:3], consumer[:3])


# ---- devices and events (CUDA's rules, modelled on CPU) --------------------------------------


def test_every_pipeline_thread_selects_the_pipelines_device_before_its_work(monkeypatch):
    """A new thread's current CUDA device is device 0: each thread must select its rank's
    device before it allocates pinned memory, records an event or enters a stream. Modelled with
    a fake device index: torch.cuda.set_device records which thread selected what (CPU has no
    CUDA context to inspect; benchmarks/gpu_multi.sh checks the contexts on real GPUs)."""
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: selected.append((threading.current_thread().name, d)))
    seen = {}

    def source():
        for i in range(4):
            seen.setdefault("data", (thread_device(), threading.current_thread().name))
            yield i

    def stage(name):
        def fn(x):
            seen.setdefault(name, (thread_device(), threading.current_thread().name))
            return x
        return fn

    pool = BufferPool([], "cuda:3")  # a rank with LOCAL_RANK 3; the pipeline takes its device from its pool
    with Pipeline(source(), [Stage("h2d", stage("h2d")), Stage("target", stage("target"))], pools=[pool]) as pipe:
        assert pipe.device == torch.device("cuda", 3)
        assert list(pipe) == [0, 1, 2, 3]
    cuda3 = torch.device("cuda", 3)
    assert {name: dev for name, (dev, _) in seen.items()} == {"data": cuda3, "h2d": cuda3, "target": cuda3}
    threads = {thread for _, thread in seen.values()}
    assert threads == {"flashdraft-data", "flashdraft-h2d", "flashdraft-target"}
    assert sorted(selected) == sorted((t, cuda3) for t in threads)  # each thread, once, at its start
    assert thread_device() is None  # the consumer's thread: the process selected its device itself


class _Stream:
    """A model of one CUDA stream: events complete in record order when the GPU gets there;
    ``synchronize`` (a host wait) is what a report must never do."""

    def __init__(self):
        self.done = 0  # events the GPU has reached
        self.recorded = 0

    def event(self, t_ms: float) -> _Event:
        self.recorded += 1
        return _Event(self, self.recorded, t_ms)


class _Event:
    def __init__(self, stream, seq, t_ms):
        self.stream, self.seq, self.t_ms = stream, seq, t_ms

    def query(self) -> bool:
        return self.seq <= self.stream.done

    def elapsed_time(self, end) -> float:
        assert self.query() and end.query(), "elapsed_time of an event that has not completed (CUDA raises)"
        return end.t_ms - self.t_ms

    def synchronize(self):
        raise AssertionError("a report waited for the GPU (synchronize)")


def test_stage_reports_never_wait_for_the_gpu_and_count_every_item_eventually():
    stream, meter = _Stream(), EventMeter()  # the meter of a pipeline stage (and of the step timer)
    for k in range(10):  # 10 forwards of 5 ms queued; the GPU has finished none
        meter.add(stream.event(10.0 * k), stream.event(10.0 * k + 5))
    assert meter.totals() == MeterTotals(0, 0.0)  # nothing completed: nothing counted, no wait
    stream.done = 7  # the GPU finished 3 forwards and started the 4th
    totals = meter.totals()
    assert totals.items == 3 and totals.seconds == pytest.approx(0.015)
    stream.done = stream.recorded
    totals = meter.totals()
    assert totals.items == 10 and totals.seconds == pytest.approx(0.050)  # every item, once


def test_the_step_timer_summarises_completed_steps_only_and_never_waits(monkeypatch):
    stream, clock = _Stream(), iter(range(0, 1000, 1))
    timer = StageTimer("cpu")
    # its marks are the modelled CUDA events below
    monkeypatch.setattr(timer.meter, "mark", lambda on=None: stream.event(float(next(clock))))
    for _ in range(4):
        with timer.stage("drafter"):
            pass
        timer.step_done()
    stream.done = 6  # the first two steps' marks (start, end, step end: 3 each)
    first = timer.summary()
    assert first.num_steps == 2 and first.stage_ms["drafter"] == 1.0
    stream.done = stream.recorded
    assert timer.summary().num_steps == 2 and timer.summary().num_steps == 0


# ---- the trainer ---------------------------------------------------------------------------


def _weights(trainer: Trainer) -> dict:
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def test_pipelined_trainer_equals_sequential(tiny_job, tmp_path):
    runs = {}
    for enabled in (False, True):
        cfg = load_config(overrides=overrides(tiny_job, tmp_path / str(enabled), train__max_steps=6,
                                              train__grad_accum=2, pipeline__enabled=str(enabled).lower()))
        trainer = Trainer(cfg)
        trainer.fit()
        runs[enabled] = ([h["loss"] for h in trainer.history if "loss" in h], _weights(trainer), trainer)
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 6
    for name, value in runs[False][1].items():
        assert torch.equal(runs[True][1][name], value), name
    report = runs[True][2].pipeline_report
    assert report.threaded and [s.name for s in report.stages] == ["data", "target", "drafter"]
    assert report.bound.endswith("-bound")


class Faulty:
    """Makes one stage of ``trainer`` raise at step 3 (after the step-2 checkpoint), by wrapping
    that stage's function: the feed's stages (FeatureStages, which the feed builds: patched on
    the class with ``monkeypatch``) or the trainer's step."""

    raised_at = 0.0

    def __init__(self, trainer, fail_in: str, monkeypatch):
        self.trainer, self.fail_in, self.target_calls = trainer, fail_in, 0
        step_fn = trainer.step_fn
        if fail_in == "data":
            step_inputs = FeatureStages.step_inputs

            def faulty_step_inputs(stages, sampler, pool, num_steps):
                for n, item in enumerate(step_inputs(stages, sampler, pool, num_steps)):
                    if n == 5:
                        while trainer.step < 3:  # the data thread runs ahead: fail once step 2 is checkpointed
                            time.sleep(0.005)
                        self._boom("data")
                    yield item

            monkeypatch.setattr(FeatureStages, "step_inputs", faulty_step_inputs)
        elif fail_in == "target":
            forward = FeatureStages.forward

            def faulty_forward(stages, item):
                if self.target_calls == 3:
                    while trainer.step < 3:  # the target thread runs ahead too: fail once step 2 is checkpointed
                        time.sleep(0.005)
                    self._boom("target")
                self.target_calls += 1
                return forward(stages, item)

            monkeypatch.setattr(FeatureStages, "forward", faulty_forward)
        else:
            def faulty_step(micro, step, position, stats):
                if step == 3:
                    self._boom("drafter")
                return step_fn(micro, step, position, stats)

            trainer.step_fn = faulty_step

    def _boom(self, where):
        Faulty.raised_at = time.monotonic()
        raise RuntimeError(f"injected {where} failure")


@pytest.mark.parametrize("stage", ["data", "target", "drafter"])
def test_a_failure_in_any_stage_ends_the_run_fast_and_keeps_the_checkpoint(tiny_job, tmp_path, stage,
                                                                           monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=20, checkpoint__save_every=2)))
    Faulty(trainer, stage, monkeypatch)
    with pytest.raises(RuntimeError, match=f"injected {stage} failure") as info:
        trainer.fit()
    assert time.monotonic() - Faulty.raised_at < 2
    assert "_boom" in "".join(traceback.format_exception(info.value))
    assert pipeline_threads() == []
    loaded = CheckpointManager(out / "checkpoints").load_latest()
    # The newest checkpoint written before the failure loads (its manifest verifies).
    assert loaded is not None and loaded.step == trainer.step - trainer.step % 2 >= 2


def test_sigterm_stops_the_pipeline_and_writes_the_final_checkpoint(tiny_job, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=20)))
    step_fn = trainer.step_fn

    def signalled(micro, step, position, stats):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled on this (main) thread
        return step_fn(micro, step, position, stats)

    trainer.step_fn = signalled
    with pytest.raises(Stopped, match=r"stopped by SIGTERM at step 3 of 20: checkpoint .*step_00000003 saved") as info:
        trainer.fit()
    assert info.value.exit_code == 143
    assert trainer.step == 3 and pipeline_threads() == []
    loaded = CheckpointManager(out / "checkpoints").load_latest()
    assert loaded.step == 3
    # The cursor is the one after step 3, not where the data thread had read ahead to.
    assert loaded.parts["trainer"]["sampler"]["consumed"] == 3
