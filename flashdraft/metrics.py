"""Observability: where the step time goes, how fast the run goes, and where metrics are written.

- :class:`EventMeter` times spans of work with CUDA events on a CUDA device (``time.perf_counter``
  on the CPU) and counts only those whose events have completed: reading it never waits for
  the GPU. :class:`StageTimer` (named stages of each step) and the feed's pipeline (each
  stage's busy time, flashdraft.feed.flow) both time with it.
- :class:`Throughput` estimates steps/s, tokens/s and the ETA over a window of recent steps.
- Sinks: JSONL (always), TensorBoard and Weights & Biases (optional, imported lazily), fanned
  out by :class:`MetricsLogger`, which writes on rank 0 only.
- :func:`format_line` renders one compact human line; :class:`Progress` shows it with a tqdm
  bar on an interactive terminal and as plain lines otherwise (log files, CI).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from flashdraft.config import METRIC_SINKS

_log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Stage timing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingSummary:
    """Mean per-step times over the steps since the previous summary.

    ``stage_ms`` has one entry per stage seen plus ``"other"``: step time not inside any stage
    (host work between stages, waiting). With non-overlapping stages the entries sum to
    ``step_ms``. Stages that overlap (e.g. run by concurrent pipeline threads) can sum to more;
    ``"other"`` is then 0.
    """

    num_steps: int
    step_ms: float
    stage_ms: dict[str, float]

    @property
    def share(self) -> dict[str, float]:
        """Fraction of the step time per stage (incl. "other")."""
        if self.step_ms <= 0:
            return {k: 0.0 for k in self.stage_ms}
        return {k: v / self.step_ms for k, v in self.stage_ms.items()}

    def as_metrics(self, prefix: str = "time/") -> dict[str, float]:
        """Flat metrics: ``time/step_ms``, ``time/<stage>_ms`` and ``time/<stage>_share``."""
        out = {f"{prefix}step_ms": self.step_ms}
        for k, v in self.stage_ms.items():
            out[f"{prefix}{k}_ms"] = v
        for k, v in self.share.items():
            out[f"{prefix}{k}_share"] = v
        return out


def take_completed(pending: deque, marks=lambda item: (item,)) -> list:
    """Pop and return the leading items of ``pending`` whose marks (``marks(item)``) have all
    completed: CUDA events whose ``query()`` is true (a host check, never a wait), or host times
    (floats). Items are queued in the order their marks were recorded, so the first one still
    pending ends the scan; it and the rest stay for a later call."""
    done = []
    while pending and all(isinstance(m, float) or m.query() for m in marks(pending[0])):
        done.append(pending.popleft())
    return done


def _elapsed_s(start: Any, end: Any) -> float:
    """Seconds between two completed marks: host times, or CUDA events (``elapsed_time``: ms)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3


@dataclass
class MeterTotals:
    """What an :class:`EventMeter` counted: ``items`` spans of ``seconds`` in all, and the named
    parts inside them (name -> (count, seconds)), in the order first seen."""

    items: int = 0
    seconds: float = 0.0
    parts: dict[str, tuple[int, float]] = field(default_factory=dict)

    def __sub__(self, earlier: MeterTotals) -> MeterTotals:
        """What was counted after ``earlier`` (the window between two reads); a part counts
        in the window only when it occurred in it."""
        parts = {}
        for name, (count, seconds) in self.parts.items():
            count0, seconds0 = earlier.parts.get(name, (0, 0.0))
            if count > count0:
                parts[name] = (count - count0, seconds - seconds0)
        return MeterTotals(self.items - earlier.items, self.seconds - earlier.seconds, parts)


class EventMeter:
    """Time spent in spans of work, read without waiting for the GPU: the one meter behind the
    step's stage timer and the pipeline's per-stage busy time.

    A span runs between two marks (``mark``): CUDA events on a CUDA meter, recorded on a stream
    in the device's own order, so a span measures when the GPU reached its start and end;
    ``time.perf_counter()`` floats on the CPU (and for host work, whatever the device). A span
    counts once its end marks have completed (``Event.query()``: a host check), so reading the
    totals never drains the stream being measured: spans still running count in a later read.
    Spans are resolved at every ``add`` too, so the queue stays as short as the device is behind
    even when nobody reads. Thread-safe.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._lock = threading.Lock()
        self._pending: deque = deque()  # (start, end, parts) not yet completed, in recording order
        self._totals = MeterTotals()

    def mark(self, stream: Any = None) -> Any:
        """Now: a timing event enqueued on ``stream`` (default: the calling thread's current
        stream) on a CUDA meter, else ``time.perf_counter()``. Never a host sync."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add(self, start: Any, end: Any, parts: Sequence[tuple[str, Any, Any]] = ()) -> None:
        """One span from ``start`` to ``end``, with its named ``parts`` ((name, start, end));
        counted once every end mark has completed."""
        with self._lock:
            self._pending.append((start, end, tuple(parts)))
            self._resolve()

    def totals(self, drain: bool = False) -> MeterTotals:
        """Everything counted since the start, over the spans whose marks have completed;
        ``drain``: first wait for the newest span (the whole run's report, when nothing follows it)."""
        with self._lock:
            if drain and self._pending:
                for mark in self._ends(self._pending[-1]):
                    if not isinstance(mark, float):
                        mark.synchronize()  # deliberate: the run's last report, no step waits on it
            self._resolve()
            t = self._totals
            return MeterTotals(t.items, t.seconds, dict(t.parts))

    @staticmethod
    def _ends(span: tuple) -> tuple:
        return (span[1], *(end for _, _, end in span[2]))

    def _resolve(self) -> None:
        t = self._totals
        for start, end, parts in take_completed(self._pending, self._ends):
            t.items += 1
            t.seconds += _elapsed_s(start, end)
            for name, s, e in parts:
                count, seconds = t.parts.get(name, (0, 0.0))
                t.parts[name] = (count + 1, seconds + _elapsed_s(s, e))


class StageTimer:
    """Per-stage wall time of training steps, without host syncs in the hot loop.

    Usage::

        with timer.stage("target_forward"):
            ...
        timer.step_done()              # once per optimizer step
        ...
        summary = timer.summary()      # at log time; never waits for the GPU

    A step runs from the previous ``step_done()`` (the first one: from the first stage entry)
    to its ``step_done()``: one span of an :class:`EventMeter`, its stages the span's parts. On
    CUDA each boundary is an event recorded on the current stream, so a stage measures when the
    GPU reached its start and end marks; a host-only stage with an idle GPU measures host time.
    Thread-safe: pipeline threads may time their own stages.
    """

    def __init__(self, device: torch.device | str = "cpu", owner_only: bool = False):
        """``owner_only``: record only stages entered on the creating thread. A pipelined
        trainer sets it, so the per-step breakdown is the main thread's and sums to its step
        time; concurrent stages (data, target) are reported by the pipeline's busy/wait split."""
        self.device = torch.device(device)
        self._owner = threading.get_ident() if owner_only else None
        self.meter = EventMeter(self.device)
        self._lock = threading.Lock()
        self._stages: list[tuple[str, Any, Any]] = []  # (name, start mark, end mark) of the open step
        self._step_start: Any = None
        self._summarised = MeterTotals()  # the meter's totals at the previous summary

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the body as stage ``name`` of the current step. No host sync."""
        if self._owner is not None and threading.get_ident() != self._owner:
            yield  # another thread's stage: the pipeline report covers it
            return
        start = self.meter.mark()
        with self._lock:
            if self._step_start is None:
                self._step_start = start
        try:
            yield
        finally:
            end = self.meter.mark()
            with self._lock:
                self._stages.append((name, start, end))

    def step_done(self) -> None:
        """Close the current step. No host sync."""
        end = self.meter.mark()
        with self._lock:
            if self._step_start is not None:
                self.meter.add(self._step_start, end, self._stages)
            self._stages = []
            self._step_start = end

    def summary(self) -> TimingSummary:
        """Mean times over the steps closed since the last summary whose events have completed;
        steps the GPU has not finished yet count in a later summary (never a host sync: at log
        time the GPU may still run the last steps)."""
        totals = self.meter.totals()
        window, self._summarised = totals - self._summarised, totals
        n = window.items
        if not n:
            return TimingSummary(0, 0.0, {})
        stage_ms = {name: 1e3 * seconds / n for name, (_, seconds) in window.parts.items()}
        step_ms = 1e3 * window.seconds / n
        stage_ms["other"] = max(0.0, step_ms - sum(stage_ms.values()))
        return TimingSummary(n, step_ms, stage_ms)


# --------------------------------------------------------------------------------------------
# Throughput and ETA
# --------------------------------------------------------------------------------------------


class Throughput:
    """Steps/s, tokens/s and ETA over the last ``window`` updates.

    Call ``update(step, tokens)`` once per step (or per log interval) with the number of steps
    completed so far and the tokens processed since the previous update, both host ints (e.g.
    from the batch plan), so this never syncs the device. A window rather than the run mean
    makes the estimate follow speed changes (warm-up, eval pauses, resumed runs).
    """

    def __init__(self, window: int = 50):
        if window < 1:
            raise ValueError(f"window={window} is invalid: use 1 or more updates")
        self._marks: deque[tuple[float, int, int]] = deque(maxlen=window + 1)
        self._tokens = 0

    def update(self, step: int, tokens: int = 0, now: float | None = None) -> None:
        self._tokens += int(tokens)
        self._marks.append((time.perf_counter() if now is None else now, int(step), self._tokens))

    def _span(self) -> tuple[float, int, int] | None:
        if len(self._marks) < 2:
            return None
        (t0, s0, k0), (t1, s1, k1) = self._marks[0], self._marks[-1]
        return (t1 - t0, s1 - s0, k1 - k0) if t1 > t0 else None

    @property
    def steps_per_s(self) -> float | None:
        span = self._span()
        return span[1] / span[0] if span else None

    @property
    def s_per_step(self) -> float | None:
        rate = self.steps_per_s
        return 1.0 / rate if rate else None

    @property
    def tokens_per_s(self) -> float | None:
        span = self._span()
        return span[2] / span[0] if span else None

    def eta_s(self, total_steps: int) -> float | None:
        """Seconds until ``total_steps`` at the recent rate; None until two updates exist."""
        rate = self.steps_per_s
        if not rate or not self._marks:
            return None
        return max(0, total_steps - self._marks[-1][1]) / rate


# --------------------------------------------------------------------------------------------
# Memory and formatting
# --------------------------------------------------------------------------------------------


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Peak memory: CUDA ``max_memory_allocated`` on a CUDA device, else this process's peak RSS.

    Host-side query (no device sync).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def format_duration(seconds: float | None) -> str:
    """45s, 12m05s, 2h08m, 3d04h; "?" when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_count(x: float) -> str:
    """950, 5.2k, 16.0k, 1.3M."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def format_bytes(n: float) -> str:
    """Binary units: 512B, 1.5K, 12.3G."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def _format_number(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def format_line(
    step: int,
    total_steps: int | None = None,
    scalars: Mapping[str, Any] | None = None,
    *,
    tokens_per_s: float | None = None,
    s_per_step: float | None = None,
    eta_s: float | None = None,
    shares: Mapping[str, float] | None = None,
    peak_mem_bytes: int | None = None,
) -> str:
    """One compact log line, e.g.::

        step 120/6000 loss 2.31 acc 0.41 tau~3.1 | 5.2k tok/s 1.31 s/step ETA 2h08m mem 61.2G
        | data 2% h2d 1% target 61% drafter 20% backward 12% sync 3% optim 1%

    (one line; wrapped here). ``scalars`` print in order as ``name value`` with 3 significant
    digits; a name ending in ``~`` is glued to its value (``tau~3.1``: an estimate). Any
    argument left None is omitted. ``shares`` are fractions (0.61 -> 61%).
    """
    head = f"step {step}/{total_steps}" if total_steps else f"step {step}"
    for name, value in (scalars or {}).items():
        head += f" {name}{_format_number(value)}" if name.endswith("~") else f" {name} {_format_number(value)}"
    groups = [head]
    speed = []
    if tokens_per_s is not None:
        speed.append(f"{format_count(tokens_per_s)} tok/s")
    if s_per_step is not None:
        speed.append(f"{s_per_step:.2f} s/step" if s_per_step < 100 else f"{format_duration(s_per_step)}/step")
    if eta_s is not None:
        speed.append(f"ETA {format_duration(eta_s)}")
    if peak_mem_bytes is not None:
        speed.append(f"mem {format_bytes(peak_mem_bytes)}")
    if speed:
        groups.append(" ".join(speed))
    if shares:
        groups.append(" ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()))
    return " | ".join(groups)


# --------------------------------------------------------------------------------------------
# Sinks
# --------------------------------------------------------------------------------------------


class MetricsSink(Protocol):
    """Receives one record per log step. Values are Python numbers or strings."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _jsonable(v: Any) -> Any:
    # Strict JSON has no NaN/Infinity; a diverged loss must still be visible, so name it. Lists
    # too: an eval in which no draft step ran has NaN per-position acceptances.
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


class JsonlSink:
    """Appends one JSON object per ``log`` call to ``path`` and flushes it, so a crash loses
    at most the record being written. Each record: ``{"step", "time" (unix s), **metrics}``.

    ``start_step``: the run goes on from this step (a resume, or 0 for a fresh run): records of
    later steps already in the file are from a run that got further before it stopped; the steps
    are trained again, so those records move to ``<name>.abandoned.jsonl`` and the file keeps one
    record per step and kind."""

    def __init__(self, path: str | os.PathLike, start_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step is not None and self.path.is_file():
            try:
                _rewind_jsonl(self.path, start_step)
            except OSError as exc:  # e.g. a full disk: training goes on, the file keeps the repeated steps
                _log.warning("metrics: %s: could not move the records after step %d aside (%s); the steps trained "
                             "again will appear twice", self.path, start_step, exc)
        self._f: TextIO | None = open(self.path, "a", encoding="utf-8")
        if self._f.tell() > 0:  # resuming: end a line torn by a crash so the next record stays parseable
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                self._f.write("\n")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._f is None:
            raise RuntimeError(f"{self.path}: metrics sink already closed")
        record = {"step": step, "time": round(time.time(), 3), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.close()
            except OSError as exc:  # the final flush of lines a full disk refused: already reported lost
                _log.warning("metrics: %s: the last records could not be written (%s)", self.path, exc)


def _rewind_jsonl(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step``; move the later ones (and any unparseable line,
    e.g. torn by a crash) to ``<name>.abandoned.jsonl``. The file is rewritten beside and renamed."""
    kept, moved = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            record_step = None
        (kept if isinstance(record_step, int) and record_step <= step else moved).append(line)
    if not moved:
        return
    with open(path.with_name(path.stem + ".abandoned.jsonl"), "a", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _require(module: str, backend: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"metrics backend {backend!r} was requested but {module.split('.')[0]!r} is not "
                           f"installed: pip install 'flashdraft[{extra}]' (or drop {backend!r} from the "
                           f"metrics backends)") from exc


class TensorBoardSink:
    """Scalars to TensorBoard event files in ``log_dir`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str | os.PathLike):
        _require("tensorboard", "tensorboard", "tensorboard")
        tb = _require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self._writer = tb.SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                self._writer.add_scalar(k, v, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Logs to a Weights & Biases run (needs the ``wandb`` package and its login/API key)."""

    def __init__(self, project: str, name: str | None = None, config: dict | None = None,
                 dir: str | os.PathLike | None = None):
        wandb = _require("wandb", "wandb", "wandb")
        self._run = wandb.init(project=project, name=name, config=config, dir=str(dir) if dir else None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Fans records out to sinks; a no-op when ``enabled`` is False (every rank but 0).

    ``log`` converts tensor values with ``.item()`` -- a host sync per value, so pass
    tensors only at log time (better: stack them and convert once before calling).
    """

    def __init__(self, sinks: Sequence[MetricsSink], enabled: bool = True):
        self.sinks = list(sinks) if enabled else []
        self.enabled = enabled
        self._failing: set[int] = set()  # sinks whose last write failed (warned once per failure run)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        clean: dict[str, Any] = {}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.item()  # deliberate sync: log time only (see class doc)
            elif hasattr(v, "item") and not isinstance(v, int | float | str | bool):
                v = v.item()  # numpy scalars
            clean[k] = v
        for sink in self.sinks:
            try:
                sink.log(step, clean)
            except OSError as exc:  # e.g. a full disk: losing a metrics line must not cost the run
                if id(sink) not in self._failing:
                    self._failing.add(id(sink))
                    _log.warning("metrics: cannot write step %d to %s (%s); training goes on, the records are lost "
                                 "until it can write again", step, getattr(sink, "path", type(sink).__name__), exc)
                continue
            self._failing.discard(id(sink))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_metrics(
    output_dir: str | os.PathLike,
    backends: Sequence[str] = ("jsonl",),
    *,
    is_main: bool | None = None,
    run_name: str | None = None,
    config: dict | None = None,
    wandb_project: str = "flashdraft",
    start_step: int | None = None,
) -> MetricsLogger:
    """Build the run's logger: ``<output_dir>/metrics.jsonl`` always, plus the optional backends.
    ``start_step``: the step the run goes on from (see JsonlSink; None: append as is).

    ``is_main`` defaults to "this is global rank 0" (flashdraft.distributed). Missing optional
    packages are reported on every rank (RuntimeError with the pip command), so no rank starts
    training while another has failed.
    """
    unknown = [b for b in backends if b not in METRIC_SINKS]
    if unknown:
        raise ValueError(f"metrics backend {unknown[0]!r} is unknown: use any of {', '.join(METRIC_SINKS)}")
    needs = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
    for b in backends:
        if b in needs and importlib.util.find_spec(needs[b][0]) is None:
            _require(needs[b][0], b, needs[b][1])  # raises the clear error
    if is_main is None:
        from flashdraft import distributed

        is_main = distributed.get_rank() == 0
    if not is_main:
        return MetricsLogger([], enabled=False)
    out = Path(output_dir)
    sinks: list[MetricsSink] = [JsonlSink(out / "metrics.jsonl", start_step)]
    if "tensorboard" in backends:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    if "wandb" in backends:
        sinks.append(WandbSink(wandb_project, name=run_name, config=config, dir=out))
    return MetricsLogger(sinks)


# --------------------------------------------------------------------------------------------
# Progress display
# --------------------------------------------------------------------------------------------


class Progress:
    """Log lines for people: a tqdm bar with lines above it on a terminal, plain lines otherwise.

    ``update(step)`` moves the bar (cheap; no-op without a bar); ``write(line)`` prints a log
    line. Disabled (silent) when ``enabled`` is False, i.e. on every rank but 0.
    """

    def __init__(self, total_steps: int | None, initial: int = 0, *, enabled: bool = True,
                 stream: TextIO | None = None, interactive: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        if interactive is None:
            interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = None
        if enabled and interactive:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial, file=self.stream, unit="step",
                             dynamic_ncols=True, smoothing=0.05)
        self._step = initial

    @property
    def interactive(self) -> bool:
        return self._bar is not None

    def update(self, step: int) -> None:
        if self._bar is not None and step > self._step:
            self._bar.update(step - self._step)
        self._step = max(self._step, step)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
