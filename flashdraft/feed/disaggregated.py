"""The disaggregated placement: target ranks compute the features, drafter ranks train on them.

``pipeline.placement=disaggregated pipeline.target_ranks=T`` on a job of W ranks
(``distributed.role_layout``): ranks ``[0, D)``, D = W - T, are drafter ranks (DDP, logging,
eval and checkpoints, exactly as a colocated job of D ranks); ranks ``[D, W)`` are target
ranks. Target rank t feeds the k = D / T consecutive drafter ranks ``[t*k, (t+1)*k)``: for each
it runs that drafter rank's batch plan (a ``BatchSampler`` with the drafter's rank and world
size) through the usual data and target stages, and sends the result. The drafter math does
not change, only who computes the features, so a disaggregated run equals a colocated run
with D ranks.

A drafter rank's side is a Feed (:class:`DrafterFeed`); a target rank's is a serve loop
(:func:`serve_features`). They talk over one link per pair, in the wire protocol of
flashdraft.feed.wire (a control channel on gloo, a one-way data channel on the device group).

Bounds: a target rank keeps at most ``pipeline.capacity`` unreceived steps per link (on CUDA
its slot is released behind the send on the device, so the data thread refills it only once
the send is done); with its own data/target read-ahead it runs at most ~3 x capacity steps
ahead of the drafter.

Failures never hang (docs/pipeline.md): a failing side sends ABORT where it can; a dead
peer's closed connection fails the other side's next send/recv at once; a hung peer fails it
after the wait's clock (flashdraft.distributed.Clocks): a drafter rank's receive after the
collective timeout, a target rank's send after the link clock (a step plus the pause -- a
checkpoint save, an eval -- its drafter rank may be in), a HELLO after the start-up timeout.
The receive of a drafter rank's DONE / STOP / ABORT stays posted for the whole run, on the
watch clock (a year; a dead drafter rank still fails it at once).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flashdraft import distributed
from flashdraft.data.batching import BatchSampler
from flashdraft.data.collate import Batch
from flashdraft.feed.flow import BufferPool, Pipeline, Stage, Watcher
from flashdraft.feed.stages import FeatureStages
from flashdraft.feed.steps import Feed, Micro, StepInput
from flashdraft.feed.wire import (
    ABORT,
    BATCH_DTYPES,
    DATA,
    DONE,
    END,
    HELLO_SIZE,
    STOP,
    Header,
    hello,
    read_hello,
)

if TYPE_CHECKING:
    from flashdraft.distributed import Dist
    from flashdraft.feed.topology import Topology

log = logging.getLogger(__name__)

Plans = Callable[[int, int], BatchSampler]  # (drafter rank, its world size) -> that rank's batch plan


# ---- drafter ranks -----------------------------------------------------------------------------


class DrafterFeed(Feed):
    """Drafter rank: the steps its target rank sends, as a (sequential) Pipeline whose source
    stage "recv" receives them on this thread. Its busy time is the time spent waiting for and
    receiving features (``recv-bound``: supply-bound); the main thread's breakdown (``timer``)
    splits it into ``wait_features`` (the target ranks are still computing) and
    ``recv_features`` (transfer). Sends the HELLO (this rank's plan and its resumed ``sampler``
    cursor) at once; closing ends the link: DONE was sent with the last step, else STOP and a
    drain up to END, or ABORT when the consumer failed. ``stop``: the run's stop request (a GracefulStop),
    which a signal passed on by the target rank sets."""

    def __init__(self, header: Header, dist: Dist, timer, sampler: BatchSampler, start_step: int,
                 total_steps: int, stop):
        """``header``: the link's step header (feed.topology.Topology)."""
        self.link = _DrafterLink(header, dist, dist.device, timer, stop)
        self.link.hello(sampler.state_dict(), start_step, total_steps)
        pool = BufferPool([[]], dist.device)  # received tensors are fresh per step: the slot only paces
        super().__init__(Pipeline(self.link.steps(pool, total_steps - start_step), [], capacity=1,
                                  threaded=False, source_name="recv", pools=[pool]), pool)

    def _finish(self, error: BaseException | None) -> None:
        if error is not None:
            self.link.abort(error)
        else:
            self.link.finish()


class _DrafterLink:
    """A drafter rank's end of its link to its target rank (main thread only)."""

    def __init__(self, header: Header, dist: Dist, device: torch.device, timer, stop):
        """``stop``: the run's stop request (``request(signum, why)``), which a signal passed on
        by the target rank sets."""
        self.header, self.dist, self.device, self.timer, self.stop = header, dist, device, timer, stop
        self.peer = dist.peers[0]
        self.expected = 0
        self.received = 0
        self.control_sent = False

    def hello(self, cursor: dict, start_step: int, total_steps: int) -> None:
        """Tell the target rank where to start: this rank's plan and the (resumed) cursor."""
        d = self.dist
        distributed.control_isend(hello(start_step, total_steps, d.rank, d.world_size, cursor),
                                  self.peer).wait()

    def steps(self, pool: BufferPool, expected: int):
        """The remaining ``expected`` steps as StepInputs (device tensors, host lengths / sample ids)."""
        self.expected = expected
        for _ in range(expected):
            slot = pool.acquire()
            yield self._receive(slot)
        self._send_control(DONE)  # as soon as the last step is in: the target rank may leave

    def _receive(self, slot) -> StepInput:
        with self.timer.stage("wait_features"):
            h = self._receive_header()
        # the target rank was asked to stop: so is this rank (if not already)
        if int(h[0]) == DATA and int(h[1]):
            self.stop.request(int(h[1]), f"target rank {self.peer} received")
        if int(h[0]) == END:
            raise RuntimeError(f"target rank {self.peer} ended the stream after {self.received} of "
                               f"{self.expected} steps; check its log")
        with self.timer.stage("recv_features"):
            micro = self._receive_payload(h)
        self.received += 1
        return StepInput(micro, slot, self.header.cursor(h))

    def _receive_payload(self, h: torch.Tensor) -> list[Micro]:
        """The micro-batches whose shapes the header ``h`` gives (device tensors; host lengths
        and sample ids from the header)."""
        device = self.device
        width, dtype = self.header.features(h)
        micro, transfers = [], []
        for rows, seq, lengths, ids in self.header.micro_batches(h):
            fields = {name: torch.empty(rows, seq, dtype=dt, device=device)
                      for name, dt in BATCH_DTYPES.items()}
            features = torch.empty(rows, seq, width, dtype=dtype, device=device)
            transfers += [distributed.irecv(t, self.peer) for t in (*fields.values(), features)]
            micro.append(Micro(Batch(**fields, lengths=lengths), ids,
                               device_batch=Batch(**fields, lengths=lengths.to(device)),
                               device_ids=torch.from_numpy(ids).to(device), features=features))
        for transfer in transfers:
            transfer.wait()
        return micro

    def _receive_header(self) -> torch.Tensor:
        h = torch.empty(self.header.size, dtype=torch.int64)
        distributed.control_irecv(h, self.peer).wait()  # on the host: no device sync for the shapes
        if int(h[0]) == ABORT:
            text = torch.empty(int(h[1]), dtype=torch.uint8)
            distributed.control_irecv(text, self.peer).wait()
            raise RuntimeError(f"target rank {self.peer} failed, so drafter rank {self.dist.rank} stops: "
                               f"{bytes(text.tolist()).decode(errors='replace')}")
        if int(h[0]) not in (DATA, END):
            raise RuntimeError(f"unexpected message kind {int(h[0])} from target rank {self.peer}: "
                               "a version mismatch?")
        return h

    def _send_control(self, kind: int) -> None:
        self.control_sent = True
        distributed.control_isend(torch.tensor([kind]), self.peer).wait()

    def finish(self) -> None:
        """After the loop: all received (DONE already sent), or stopped early: STOP, then take
        (and drop) what the target rank had already sent, up to its END."""
        if self.control_sent:
            return
        self._send_control(STOP)
        while int((h := self._receive_header())[0]) != END:
            self._receive_payload(h)

    def abort(self, exc: BaseException) -> None:
        """This rank failed: tell the target rank (best effort; its wait is bounded anyway)."""
        if self.control_sent:
            return
        with contextlib.suppress(distributed.CollectiveError, RuntimeError):
            self._send_control(ABORT)


# ---- target ranks ------------------------------------------------------------------------------


def serve_features(stages: FeatureStages, dist: Dist, topology: Topology, plans: Plans, stop, *,
                   log_every: int) -> dict:
    """Target rank: run the data and target stages for each served drafter rank and send every
    step's features, until they all got their steps (DONE) or stopped (STOP, answered END).

    The stages run in a Pipeline (``pipeline.enabled``) whose consumer, this thread, is the
    "send" stage: its busy time is time spent waiting for the drafter ranks to take the
    features (``send-bound``: drafter-bound). A drafter's ABORT, or an exception here (sent on as
    ABORT), raises. ``stop`` (a GracefulStop): a signal this rank gets is passed on to its drafter
    ranks with the next step sent, so they stop and checkpoint as if they had got it. Returns
    ``{"steps": steps sent per link, "stopped": whether the drafter ranks stopped early}`` and
    logs the whole run's stage split (and a line every ``log_every`` steps). ``plans(rank,
    world_size)``: the batch plan of the drafter rank a HELLO names (the one it trains on)."""
    capacity = stages.pipeline.capacity
    # a tensor-parallel target group: its first rank talks, the others mirror it
    sends = dist.tensor_rank == 0
    links = _hello_links(topology.header, stages, dist, plans)
    num_steps = links[0].num_steps
    if any(link.num_steps != num_steps for link in links):
        raise RuntimeError(f"target rank {dist.global_rank}: its drafter ranks asked for different step "
                           f"counts ({[link.num_steps for link in links]}); they must resume from the same "
                           "checkpoint")
    pool = stages.buffer_pool(extra_slots=capacity * len(links))  # + the steps links hold unreceived
    topology.prepare(stages, num_steps)
    target = Stage("target", lambda pair: (pair[0], stages.forward(pair[1])), device=stages.device,
                   h2d=lambda pair: (pair[0], stages.h2d(pair[1])))
    pipe = Pipeline(_step_inputs(stages, links, pool, num_steps), [target], capacity=capacity,
                    threaded=topology.threaded, consumer_name="send", pools=[pool],
                    join_timeout_s=stages.pipeline.join_timeout_s)
    sent, stopped_early = 0, False  # steps sent to every link
    try:
        # A SIGTERM / Ctrl-C is the drafter ranks' to act on (they checkpoint, then send STOP):
        # this rank keeps serving until they do (the caller holds a GracefulStop around this).
        with pipe:
            for k, item in pipe:
                # the group agrees (one tiny all-reduce; none unsharded): go on, stop (1) or fail (2: a
                # drafter rank sent ABORT, which only the first rank sees), and the signal to pass on
                try:
                    vote, failure = int(sends and any(link.stopped() for link in links)), ""
                except RuntimeError as exc:
                    vote, failure = 2, str(exc)
                agreed = distributed.target_group_max(torch.tensor(
                    [vote, stop.signum],
                    device=stages.device)).tolist()  # on the device: NCCL groups take no host tensors
                if agreed[0] == 2:
                    raise RuntimeError(failure or f"target rank {dist.global_rank}: a drafter rank of this "
                                                  "target group failed (it sent ABORT to the group's first "
                                                  "rank); see its log")
                if agreed[0]:
                    break
                if sends:
                    links[k].send(item, pool, agreed[1])
                else:
                    pool.release(item.slot)
                if k < len(links) - 1:
                    continue
                sent += 1
                if sent % log_every == 0:
                    log.info("target rank %d: step %d/%d sent; %s", dist.global_rank, sent, num_steps,
                             _busy(pipe.report()))
            if sends:
                for link in links:
                    link.finish(pool)
                stopped_early = any(link.stopped_early for link in links)
            stopped_early = bool(distributed.target_group_max(torch.tensor([int(stopped_early)],
                                                                           device=stages.device)).item())
    except BaseException as exc:
        if sends:
            _abort(links, exc)
        raise
    log.info("target rank %d: done, %d steps per drafter rank; whole run: %s", dist.global_rank, sent,
             _busy(pipe.report(window=False)))
    return {"steps": sent, "stopped": stopped_early}


def _hello_links(header: Header, stages: FeatureStages, dist: Dist, plans: Plans) -> list[_TargetLink]:
    """The links of this rank's drafter ranks, their HELLOs received. In a tensor-parallel
    target group the first rank receives them and passes them on to the others, whose links
    only plan (they send nothing): every rank of the group runs the same batches."""
    if dist.tensor_size == 1:
        links = [_TargetLink(header, stages, d) for d in dist.peers]
        for link in links:
            link.start(link.receive_hello(), plans)
        return links
    device = stages.device  # NCCL groups take no host tensors
    links = [_TargetLink(header, stages, d) for d in dist.peers] if dist.tensor_rank == 0 else []
    hellos = [link.receive_hello() for link in links]
    # The HELLOs come once the drafter ranks have resumed: the group's other ranks wait for them
    # host-side, on the start-up clock; the group's broadcasts below then start at once.
    distributed.host_barrier("the drafter ranks' HELLOs (sent once they have resumed)", "startup")
    count = int(distributed.target_group_broadcast(torch.tensor([len(links)], device=device)).item())
    if dist.tensor_rank:
        links = [_TargetLink(header, stages, None) for _ in range(count)]
    stacked = torch.stack(hellos).to(device) if hellos else torch.empty(count, HELLO_SIZE, dtype=torch.int64,
                                                                         device=device)
    for link, msg in zip(links, distributed.target_group_broadcast(stacked).cpu()):
        link.start(msg, plans)
    return links


def _busy(report) -> str:
    """'data 1.2 / target 30.1 / send 5.0 busy ms per item, target-bound' (an item: one drafter rank's
    step)."""
    parts = " / ".join(f"{s.name} {s.busy_ms_per_item:.1f}" for s in report.stages)
    return f"{parts} busy ms per item (one drafter rank's step), {report.bound}"


def _step_inputs(stages: FeatureStages, links: list[_TargetLink], pool: BufferPool, num_steps: int):
    """Data stage: each served drafter rank's next step in turn, as ``(link index, StepInput)``."""
    for _ in range(num_steps):
        for k, link in enumerate(links):
            slot = pool.acquire()
            item = stages.collate_step(link.batches, slot, link.sampler)
            if item is None:  # the plan ended (the drafter ranks asked for the steps it has: not expected)
                pool.release(slot)
                return
            yield k, item


class _TargetLink:
    """A target rank's end of its link to one drafter rank (main thread only)."""

    def __init__(self, header: Header, stages: FeatureStages, peer: int | None):
        """``peer`` None: a mirror, on a rank of a tensor-parallel target group that computes
        the features its group's first rank sends (it plans the same batches, sends nothing)."""
        self.stages, self.peer, self.header = stages, peer, header
        self.capacity = stages.pipeline.capacity
        self.pending: deque = deque()  # (transfers, item, header) sent but not yet received, oldest first
        self.control = torch.zeros(1, dtype=torch.int64)  # on the control channel: host memory
        self.control_watch: Watcher | None = None  # the wait for the drafter rank's control message
        self.stopped_early = False  # the drafter rank sent STOP before its last step (a stop request)

    def receive_hello(self) -> torch.Tensor:
        """The drafter rank's start: int64 [start step, total steps, its rank, its world, *cursor]."""
        msg = torch.empty(HELLO_SIZE, dtype=torch.int64)
        # sent once the drafter rank has resumed (reading a checkpoint): a start-up wait
        distributed.control_irecv(msg, self.peer, "startup").wait()
        return msg

    def start(self, msg: torch.Tensor, plans: Plans) -> None:
        """Build the drafter rank's sampler from its HELLO ``msg`` (``plans(rank, world_size)``);
        post the receive of its one control message (not on a mirror), on the control channel:
        it stays posted until the drafter rank's end, and there holds back nothing (on the data
        channel, under NCCL, it would hold back every send to that rank)."""
        start, total, rank, world_size, cursor = read_hello(msg)
        self.sampler = plans(rank, world_size)
        self.sampler.load_state_dict(cursor)
        self.batches = iter(self.sampler)
        self.num_steps = total - start
        if self.peer is not None:
            transfer = distributed.control_irecv(self.control, self.peer, "watch")  # posted for the whole run
            # gloo tells a receive's completion only to a wait: a thread waits, stopped() polls it
            self.control_watch = Watcher(transfer.wait, f"flashdraft-control-{self.peer}")

    def stopped(self) -> bool:
        """Whether the drafter rank has sent its control message early (STOP, or ABORT: raises);
        never blocks."""
        if not self.control_watch.done():
            return False
        self.control_watch.result()  # a dead drafter rank: its CollectiveError
        kind = int(self.control)
        if kind == ABORT:
            raise RuntimeError(f"drafter rank {self.peer} failed (it sent ABORT); see its log for the error")
        return kind == STOP

    def send(self, item: StepInput, pool: BufferPool, signum: int = 0) -> None:
        """Start sending ``item``; first wait for the oldest step while ``capacity`` are unreceived."""
        while len(self.pending) >= self.capacity:
            self._complete_oldest(pool)
        header, payload = self.header.step(item, signum)
        transfers = [distributed.control_isend(header, self.peer)]  # the header first: the shapes to post
        transfers += [distributed.isend(t, self.peer) for t in payload]
        self.pending.append((transfers, item, header))

    def _complete_oldest(self, pool: BufferPool) -> None:
        transfers, item, _ = self.pending.popleft()
        for transfer in transfers:
            transfer.wait()
        pool.release(item.slot)

    def finish(self, pool: BufferPool) -> None:
        """Wait for every pending step to be received and for the drafter rank's control
        message; answer STOP with END (the drafter rank drains up to it)."""
        while self.pending:
            self._complete_oldest(pool)
        # the drafter rank trains its last step, and may then pause (a stop's checkpoint) before its STOP
        if not self.control_watch.wait(distributed.clock("link")):
            raise distributed.CollectiveError(
                f"drafter rank {self.peer} sent no DONE / STOP within {distributed.describe_clock('link')} "
                "after its last step (hung or dead: see its log)")
        if self.stopped():
            self.stopped_early = True
            self._send_control(END)

    def _send_control(self, kind: int, message: str = "") -> None:
        for transfer in self.start_control(kind, message):
            transfer.wait()

    def start_control(self, kind: int, message: str = "") -> list:
        header, payload = self.header.control(kind, message)
        return [distributed.control_isend(t, self.peer) for t in (header, *payload)]


def _abort(links: list[_TargetLink], exc: BaseException) -> None:
    """This rank failed: tell every drafter rank why. Best effort: a drafter rank that never
    receives it fails on the closed connection or after its receive's clock. All sends start
    before any is waited for: a drafter rank stuck in a collective with another drafter rank
    must not hold up that one's message (which is what frees it)."""
    message, transfers = f"{type(exc).__name__}: {exc}", []
    for link in links:
        with contextlib.suppress(distributed.CollectiveError, RuntimeError):
            transfers += link.start_control(ABORT, message)
    for transfer in transfers:
        with contextlib.suppress(distributed.CollectiveError, RuntimeError):
            transfer.wait()
