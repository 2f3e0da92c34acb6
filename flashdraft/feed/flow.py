"""The feed's engine: the one module that owns threads, CUDA streams and events.

Stages are connected by bounded :class:`Channel` s::

    source (data thread)  --ch-->  stage 1 (thread)  --ch-->  ...  --ch-->  consumer (the caller's thread)

The source is an iterator whose ``next()`` runs in the data thread (batch plan + collate);
each :class:`Stage` runs ``fn(item)`` in its own thread; the consumer iterates the
:class:`Pipeline` on the thread that created it (the trainer's main thread: the only thread
that ever runs a collective). Channels hold at most ``capacity`` items, so a fast stage runs
at most ``capacity`` items ahead and memory stays bounded.

Failure contract:
- An exception in any stage (or the source) is kept, every channel is cancelled, and the
  consumer's next ``next()`` re-raises THAT exception object (its traceback still shows the
  stage's frames; a note names the stage). Every thread then exits.
- ``close()`` (also on ``with`` exit, and on any consumer exception) cancels every channel and
  joins every thread: a producer blocked on a full channel whose consumer is gone wakes up and
  exits. A thread busy inside ``fn`` exits after that call returns; ``close`` waits up to
  ``join_timeout_s`` and then logs the names of threads still alive (they are daemons).
- Nothing is dropped silently: a normal end (source exhausted) is ``StopIteration`` only after
  every item produced has been consumed.

CUDA (``Stage(device=cuda)``): the stage's ``h2d`` runs on a copy stream, ``fn`` on the
stage's own compute stream after an event recorded on the copy stream; the output is handed
over with an event that the consumer's stream waits on (no host sync anywhere). Tensors cross
streams with ``record_stream``, so the caching allocator never recycles a block while another
stream may still use it. On CPU the same engine runs with threads only (torch ops release the
GIL, so stages overlap on separate cores).

``threaded=False`` runs the very same stages inline on the consumer's thread: the sequential
baseline, with the same per-stage accounting.

Devices: a new thread's current CUDA device is device 0, whatever the process selected, so
every thread this module starts first runs :func:`enter_device` with the pipeline's device
(as torch's own pin-memory thread does). Without it, a rank with LOCAL_RANK > 0 would create a
CUDA context on GPU 0 at its first pinned allocation, event or stream switch (and leaving
``torch.cuda.stream(...)`` would make device 0 current again).

Reports never wait for the GPU: each stage's busy time is an :class:`~flashdraft.metrics.EventMeter`
(the step's stage timer's too), which counts a device stage's items once their events have
completed (``Event.query()``); the rest are carried to the next report.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

from flashdraft.metrics import EventMeter, MeterTotals

log = logging.getLogger(__name__)

_THREAD = threading.local()


def enter_device(device: torch.device | str | None) -> None:
    """Select ``device`` for the calling thread: the first call of every thread that may touch
    CUDA (a pinned allocation, an event, a stream, a copy). A CUDA device becomes the thread's
    current device (a new thread starts on device 0); any device is remembered as the thread's
    own (``thread_device``), so tests can see the selection on CPU."""
    device = torch.device(device) if device is not None else None
    _THREAD.device = device
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def thread_device() -> torch.device | None:
    """The device the calling thread selected with ``enter_device`` (None: it never did)."""
    return getattr(_THREAD, "device", None)


def record_event(device: torch.device | str) -> Any:
    """A CUDA event on ``device``'s current stream (of the calling thread), after the work queued
    there so far; None for the CPU (its copies are done when they return)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class HostWorkers:
    """A few threads for host-memory work that releases the GIL (memcpy, ``preadv``), e.g. the
    feature cache's row copies. Each selects ``device`` first, like every thread here."""

    def __init__(self, threads: int, device: torch.device | str | None = None):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="flashdraft-host",
                                        initializer=enter_device, initargs=(device,))

    def run(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> None:
        """``fn(item)`` for every item, concurrently; returns when all are done (re-raises the
        first error)."""
        for _ in self._pool.map(fn, items):
            pass

    def close(self) -> None:
        self._pool.shutdown()


class Watcher:
    """One blocking call on a daemon thread of its own, so that its owner can poll for its end
    without blocking: a receive that stays posted for a whole run (a feature link's control
    message, waited on its own long clock: flashdraft.distributed's "watch"). A gloo
    point-to-point op reports its completion only to a ``wait()`` (its ``is_completed()`` stays
    False until then), and a ``wait`` whose timeout expires closes the connection, so the only
    way to learn of it early is a thread that waits. Daemon: a call still blocked at exit never
    holds the process (a dead peer fails it anyway)."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._done = threading.Event()
        self._error: BaseException | None = None

        def run():
            try:
                fn()
            except BaseException as exc:  # handed to the owner by result()
                self._error = exc
            finally:
                self._done.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def done(self) -> bool:
        """Whether the call has returned or raised; never blocks."""
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for the call; True once it has ended (then see ``result``)."""
        return self._done.wait(timeout_s)

    def result(self) -> None:
        """After the call ended: re-raise its exception, if any."""
        if self._error is not None:
            raise self._error


class ChannelClosed(Exception):
    """``get`` on a closed and drained channel (normal end of stream), or ``put`` after close."""


class Cancelled(Exception):
    """The channel was cancelled: the pipeline is shutting down (error, stop or close)."""


class Channel:
    """A bounded FIFO between two threads, with close (end of stream) and cancel (tear-down).

    ``put`` blocks while full; ``get`` blocks while empty. ``cancel()`` wakes every waiter:
    both then raise :class:`Cancelled`, and items still queued are dropped (the pipeline is
    being torn down; its error, if any, is reported by the pipeline). Time spent blocked is
    accumulated: ``put_wait_s`` (producer blocked: the consumer is slower) and ``get_wait_s``
    (consumer starved: the producer is slower).
    """

    def __init__(self, capacity: int, name: str = "channel"):
        if capacity < 1:
            raise ValueError(f"channel {name}: capacity={capacity} is invalid; use 1 or more")
        self.capacity = capacity
        self.name = name
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._cancelled = False
        self.put_wait_s = 0.0
        self.get_wait_s = 0.0

    def put(self, item: Any) -> None:
        with self._cond:
            if len(self._items) >= self.capacity and not self._cancelled:
                t0 = time.perf_counter()
                while len(self._items) >= self.capacity and not self._cancelled:
                    self._cond.wait(0.25)  # a timeout only as a safety net: cancel() notifies
                self.put_wait_s += time.perf_counter() - t0
            if self._cancelled:
                raise Cancelled(self.name)
            if self._closed:
                raise ChannelClosed(f"put on closed channel {self.name}")
            self._items.append(item)
            self._cond.notify_all()

    def get(self) -> Any:
        with self._cond:
            if not self._items and not self._closed and not self._cancelled:
                t0 = time.perf_counter()
                # Short waits keep the main thread responsive to signal handlers (Ctrl-C).
                while not self._items and not self._closed and not self._cancelled:
                    self._cond.wait(0.25)
                self.get_wait_s += time.perf_counter() - t0
            if self._cancelled:
                raise Cancelled(self.name)
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
            raise ChannelClosed(self.name)

    def close(self) -> None:
        """End of stream: ``get`` drains what is queued, then raises ChannelClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """Tear down: wake every waiter; they raise Cancelled."""
        with self._cond:
            self._cancelled = True
            self._items.clear()
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class BufferPool:
    """A fixed set of reusable slots (e.g. pinned CollateBuffers), handed out and returned.

    ``acquire`` (any thread) blocks until a slot is free; ``release(slot)`` (the consumer,
    after it is done with the slot's data) records an event on the current CUDA stream, and
    the next ``acquire`` of that slot waits for it on the host before anyone refills it. So a
    pinned buffer is never overwritten while a copy or kernel may still read it, whatever the
    stream. On CPU there is no event. Cancelled with its pipeline (``cancel``).
    """

    def __init__(self, slots: Iterable[Any], device: torch.device | str = "cpu"):
        slots = list(slots)
        self.device = torch.device(device)
        self._free = Channel(max(1, len(slots)), "buffer-pool")
        self._cuda = self.device.type == "cuda"
        for slot in slots:
            self._free.put((slot, None))

    def acquire(self) -> Any:
        slot, event = self._free.get()
        if event is not None:
            event.synchronize()  # host wait in the data thread only: the slot's last reader is done
        return slot

    def release(self, slot: Any) -> None:
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            # On the releasing thread's current stream of the pool's device (it selected that
            # device with enter_device), after its last use of the slot.
            event.record(torch.cuda.current_stream(self.device))
        try:
            self._free.put((slot, event))
        except Cancelled:
            pass  # torn down: nobody will acquire again, and the consumer's own error must win

    def cancel(self) -> None:
        self._free.cancel()


@dataclass
class Stage:
    """One pipeline stage: ``fn(item) -> item`` run in its own thread.

    device: a CUDA device makes this a device stage: ``h2d(item)`` (if given) runs on a copy
    stream, ``fn`` on the stage's own compute stream, and the consumer receives the output
    only through a CUDA event (see the module doc). None or CPU: plain host calls.
    h2d: the host-to-device copy part (non_blocking copies from pinned memory), or None.
    """

    name: str
    fn: Callable[[Any], Any]
    device: torch.device | str | None = None
    h2d: Callable[[Any], Any] | None = None


@dataclass
class StageReport:
    """One stage's time over a window: busy (doing its work), starved (waiting on its input
    channel: upstream is slower), blocked (waiting on its full output channel: downstream is
    slower). Times in seconds; ``items`` processed in the window."""

    name: str
    items: int
    busy_s: float
    starved_s: float
    blocked_s: float

    @property
    def busy_ms_per_item(self) -> float:
        return 1e3 * self.busy_s / max(1, self.items)


@dataclass
class PipelineReport:
    """Per-stage busy / starved / blocked split over a window and the resulting bound; ``notes``:
    lines the owner adds (e.g. the trainer's feature-cache counters), printed by ``format``."""

    stages: list[StageReport]
    wall_s: float
    items: int
    threaded: bool
    notes: list[str] = field(default_factory=list)

    @property
    def slowest(self) -> StageReport:
        return max(self.stages, key=lambda s: s.busy_ms_per_item)

    @property
    def bound(self) -> str:
        """'<stage>-bound': the stage with the most busy time per item sets the pace."""
        return f"{self.slowest.name}-bound"

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ideal_items_per_s(self) -> float:
        """1 / slowest stage (perfect overlap); for a sequential run: what pipelining could give."""
        ms = self.slowest.busy_ms_per_item
        return 1e3 / ms if ms > 0 else 0.0

    def as_metrics(self, prefix: str = "pipe/") -> dict[str, Any]:
        out: dict[str, Any] = {f"{prefix}bound": self.bound}
        for s in self.stages:
            n = max(1, s.items)
            out[f"{prefix}{s.name}_busy_ms"] = 1e3 * s.busy_s / n
            out[f"{prefix}{s.name}_starved_ms"] = 1e3 * s.starved_s / n
            out[f"{prefix}{s.name}_blocked_ms"] = 1e3 * s.blocked_s / n
        return out

    def format(self) -> str:
        lines = [f"{'stage':<10} {'items':>6} {'busy ms/it':>11} {'starved ms/it':>14} {'blocked ms/it':>14} "
                 f"{'busy %':>7}"]
        for s in self.stages:
            n = max(1, s.items)
            share = 100 * s.busy_s / self.wall_s if self.wall_s > 0 else 0.0
            lines.append(f"{s.name:<10} {s.items:>6} {1e3 * s.busy_s / n:>11.2f} {1e3 * s.starved_s / n:>14.2f} "
                         f"{1e3 * s.blocked_s / n:>14.2f} {share:>6.1f}%")
        lines.append(f"{'threaded' if self.threaded else 'sequential'}: {self.items_per_s:.2f} items/s, "
                     f"{self.bound} (ideal {self.ideal_items_per_s:.2f} items/s)")
        return "\n".join(lines + self.notes)


@dataclass
class _Handoff:
    """An item crossing from a device stage: valid on the consumer's stream after ``event``."""

    item: Any
    event: Any


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested lists / tuples / dicts / dataclasses (for record_stream)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))


class Pipeline:
    """Run ``source`` and ``stages`` concurrently; iterate it to consume their outputs.

    Usage (on the thread that will consume; that thread alone runs collectives)::

        with Pipeline(batches, [Stage("target", forward, device=dev, h2d=copy)], capacity=2) as pipe:
            for item in pipe:            # re-raises a stage's exception here
                train(item)              # the consumer stage, timed as ``consumer_name``
        print(pipe.report().format())

    source: an iterable; its ``next()`` runs in the data thread (timed as ``source_name``).
    capacity: the bound of every channel (items a stage may run ahead of its consumer).
    threaded: False runs everything inline on the consumer's thread (sequential baseline).
    device: the device every pipeline thread selects first (``enter_device``); None: the first
    device stage's, else the first pool's.
    """

    def __init__(self, source: Iterable, stages: list[Stage], *, capacity: int = 2, threaded: bool = True,
                 source_name: str = "data", consumer_name: str = "drafter", pools: list[BufferPool] = (),
                 join_timeout_s: float = 5.0, device: torch.device | str | None = None):
        if capacity < 1:
            raise ValueError(f"pipeline capacity={capacity} is invalid: use 1 or more (2 is a good default)")
        self.stages = list(stages)
        self.threaded = threaded
        self.capacity = capacity
        self.join_timeout_s = join_timeout_s
        self._source = iter(source)
        self._pools = list(pools)
        found = [s.device for s in self.stages if s.device is not None] + [p.device for p in self._pools]
        self.device = torch.device(device) if device is not None else (torch.device(found[0]) if found else None)
        self._names = [source_name] + [s.name for s in self.stages] + [consumer_name]
        # each stage's busy time; a device stage's on its compute stream's events
        self._meters = [EventMeter()] + [EventMeter(s.device) for s in self.stages] + [EventMeter()]
        self._channels = [Channel(capacity, f"{source_name}->{s.name}") for s in self.stages]
        self._channels.append(Channel(capacity,
                                      f"{self.stages[-1].name if self.stages else source_name}->{consumer_name}"))
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self._consumer_since: float | None = None
        self._started = self._window_start = time.perf_counter()
        self._snapshot = [MeterTotals()] * len(self._meters), [(0.0, 0.0)] * len(self._channels)
        self._setup_cuda()
        if threaded:
            self._start()

    # ---- CUDA streams ------------------------------------------------------------------------

    def _setup_cuda(self) -> None:
        """Streams for device stages; each stage's consumer stream (for record_stream/wait)."""
        self._streams: list[tuple[Any, Any] | None] = []
        for s in self.stages:
            dev = torch.device(s.device) if s.device is not None else None
            if dev is not None and dev.type == "cuda":
                self._streams.append((torch.cuda.Stream(dev), torch.cuda.Stream(dev)))  # (copy, compute)
            else:
                self._streams.append(None)
        self._main_stream = None
        for s in self.stages:
            if s.device is not None and torch.device(s.device).type == "cuda":
                # Captured on the consumer's thread at construction: the stream it will compute on.
                self._main_stream = torch.cuda.current_stream(torch.device(s.device))
                break

    def _consumer_stream(self, i: int):
        """The stream that will use stage i's output: the next device stage's copy stream
        (where its h2d runs), or the consumer's stream."""
        for j in range(i + 1, len(self.stages)):
            if self._streams[j] is not None:
                return self._streams[j][0]
        return self._main_stream

    def _run_stage(self, i: int, item: Any) -> Any:
        stage, meter, streams = self.stages[i], self._meters[i + 1], self._streams[i]
        if streams is None:
            start = meter.mark()
            if stage.h2d is not None:
                item = stage.h2d(item)
            out = stage.fn(item)
            meter.add(start, meter.mark())
            return out
        copy, compute = streams
        if isinstance(item, _Handoff):
            copy.wait_event(item.event)
            item = item.item
        with torch.cuda.stream(copy):
            if stage.h2d is not None:
                item = stage.h2d(item)  # non_blocking copies from pinned memory, on the copy stream
            copied = torch.cuda.Event()
            copied.record()
        # Busy time starts once the compute stream is free for this item: what it then waits of
        # the copy, and the forward. (Started on the copy stream, it would also count the wait
        # for the previous item's forward whenever this thread runs ahead.)
        start = meter.mark(compute)
        compute.wait_event(copied)
        for t in _tensors(item):  # allocated on the copy stream, read on the compute stream
            if t.is_cuda:
                t.record_stream(compute)
        with torch.cuda.stream(compute):
            out = stage.fn(item)
            done = meter.mark()
        consumer = self._consumer_stream(i)
        for t in _tensors(out):  # allocated here, read on the consumer's stream later
            if t.is_cuda:
                t.record_stream(consumer)
        meter.add(start, done)
        return _Handoff(out, done)

    # ---- threads -----------------------------------------------------------------------------

    def _start(self) -> None:
        workers = ([(self._names[0], self._source_loop)]
                   + [(s.name, self._stage_loop, i) for i, s in enumerate(self.stages)])
        for spec in workers:
            name, target, *args = spec
            t = threading.Thread(target=self._guard, args=(name, target, *args), name=f"flashdraft-{name}", daemon=True)
            self._threads.append(t)
        for t in self._threads:
            t.start()

    def _guard(self, name: str, loop: Callable, *args) -> None:
        """Thread body: select the pipeline's device, run the loop; on any exception keep it (the
        first wins) and cancel all."""
        try:
            enter_device(self.device)
            loop(*args)
        except Cancelled:
            pass
        except BaseException as exc:  # every failure must reach the consumer
            with self._error_lock:
                if self._error is None:
                    self._error = exc
            self._cancel_all()
            if hasattr(exc, "add_note"):  # Python >= 3.11; after the cancel, which must happen whatever this does
                exc.add_note(f"(raised in pipeline stage {name!r}, thread {threading.current_thread().name})")

    def _source_loop(self) -> None:
        meter, out = self._meters[0], self._channels[0]
        while True:
            start = meter.mark()
            try:
                item = next(self._source)
            except StopIteration:
                out.close()
                return
            meter.add(start, meter.mark())
            out.put(item)

    def _stage_loop(self, i: int) -> None:
        inp, out = self._channels[i], self._channels[i + 1]
        while True:
            try:
                item = inp.get()
            except ChannelClosed:
                out.close()
                return
            out.put(self._run_stage(i, item))

    def _cancel_all(self) -> None:
        for ch in self._channels:
            ch.cancel()
        for pool in self._pools:
            pool.cancel()

    # ---- the consumer side -------------------------------------------------------------------

    def __iter__(self) -> Pipeline:
        return self

    def __next__(self) -> Any:
        """The next item, ready on this thread's current stream. Re-raises a stage's error."""
        if self._consumer_since is not None:  # the consumer's work on the previous item
            self._meters[-1].add(self._consumer_since, time.perf_counter())
            self._consumer_since = None
        if self._closed:
            raise StopIteration
        try:
            item = self._next_threaded() if self.threaded else self._next_inline()
        except StopIteration:
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        if isinstance(item, _Handoff):
            torch.cuda.current_stream(self._main_stream.device).wait_event(item.event)  # GPU-side wait, no host sync
            item = item.item
        self._consumer_since = time.perf_counter()
        return item

    def _next_threaded(self) -> Any:
        try:
            return self._channels[-1].get()
        except ChannelClosed:
            raise StopIteration from None
        except Cancelled:
            if self._error is not None:
                raise self._error from None
            raise

    def _next_inline(self) -> Any:
        start = self._meters[0].mark()
        item = next(self._source)  # StopIteration ends the run
        self._meters[0].add(start, self._meters[0].mark())
        for i in range(len(self.stages)):
            item = self._run_stage(i, item)
        return item

    def close(self) -> None:
        """Cancel every channel and join every thread (idempotent; safe from the consumer's
        thread at any time, e.g. in ``finally``). Threads still alive after ``join_timeout_s``
        are logged; they are daemons and exit when their current call returns."""
        if self._consumer_since is not None:
            self._meters[-1].add(self._consumer_since, time.perf_counter())
            self._consumer_since = None
        if self._closed:
            return
        self._closed = True
        self._cancel_all()
        deadline = time.monotonic() + self.join_timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("pipeline threads still running %.1f s after close: %s", self.join_timeout_s, alive)

    def alive_threads(self) -> list[str]:
        return [t.name for t in self._threads if t.is_alive()]

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def report(self, window: bool = True) -> PipelineReport:
        """Busy / starved / blocked per stage: since the previous windowed report (window=True,
        for periodic logs) or since the start (window=False, the whole run).

        Starved = waiting on the input channel; blocked = waiting on the full output channel.
        Call from the consumer's thread. A windowed report never waits for the GPU: a device
        stage counts the items its stream has finished (the others count in a later report); the
        whole run's report waits for its last items, since no report follows it."""
        meters = [m.totals(drain=not window) for m in self._meters]
        now = time.perf_counter()
        waits = [(ch.put_wait_s, ch.get_wait_s) for ch in self._channels]
        if window:
            base_meters, base_waits = self._snapshot
            start = self._window_start
            self._snapshot, self._window_start = (meters, waits), now
        else:
            base_meters, base_waits, start = [MeterTotals()] * len(meters), [(0.0, 0.0)] * len(waits), self._started
        delta = [(p - p0, g - g0) for (p, g), (p0, g0) in zip(waits, base_waits)]
        reports = []
        for k, (name, totals, base) in enumerate(zip(self._names, meters, base_meters)):
            starved = delta[k - 1][1] if k > 0 else 0.0  # get-wait on the input channel
            blocked = delta[k][0] if k < len(self._channels) else 0.0  # put-wait on the output channel
            busy = totals - base
            reports.append(StageReport(name, busy.items, busy.seconds, starved, blocked))
        return PipelineReport(reports, now - start, reports[-1].items, self.threaded)
