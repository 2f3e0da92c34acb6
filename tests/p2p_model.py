"""The device group's point-to-point ops, recorded on gloo and replayed under NCCL's rule.

On CPU the feature links run over gloo, where a pending receive never holds back a send: a
protocol that deadlocks under NCCL passes every gloo test. This module makes NCCL's rule
checkable here:

- ``install_recorder`` (in a worker, before the job starts) wraps torch.distributed's
  point-to-point calls and appends every op on the DEVICE group (the default group: NCCL on
  CUDA) to a per-rank JSON-lines file, in posting order; ops on other groups (the gloo control
  channel) are recorded with their group's label but are not subject to the rule.
- ``nccl_deadlocks`` replays the recorded sequences under the rule ProcessGroupNCCL follows for
  un-batched p2p ops: all ops between a pair of ranks share one communicator and one stream, so
  they run in posting order, and the k-th op of one side pairs with the k-th op of the other.
  Each side's queue advances only when both heads are a send and a receive of the same size; two
  receives (or two sends, or sizes that differ) at the heads block both sides for good.
- ``flow_violations``: the stricter contract of the links (the data channel flows one way):
  no receive on the device group by a rank that sends to that peer, no op against the flow.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as tdist

ENV = "FLASHDRAFT_TEST_P2P_LOG"  # a directory: workers record their device-group p2p ops there


@dataclass(frozen=True)
class Op:
    rank: int  # the global rank that posted it
    kind: str  # "send" or "recv"
    peer: int  # the global rank on the other side
    group: str  # "device" (the default group) or "control" / "other"
    dtype: str
    numel: int

    def matches(self, other: Op) -> bool:
        """Whether ``self`` and ``other`` (posted by ``self.peer``) pair up: a send and a receive
        between the two ranks, of the same element type and count (what NCCL requires)."""
        return ({self.kind, other.kind} == {"send", "recv"} and self.peer == other.rank and other.peer == self.rank
                and (self.dtype, self.numel) == (other.dtype, other.numel))


def install_recorder(directory: str | os.PathLike) -> None:
    """Record this process's p2p ops (rank from RANK) into ``directory``/rank<R>.jsonl, one line
    per op as it is posted (flushed: a process that is killed keeps what it posted)."""
    from flashdraft import distributed

    rank = int(os.environ["RANK"])
    log = open(Path(directory) / f"rank{rank}.jsonl", "a", buffering=1)  # lives with the process

    def label(group) -> str:
        if group is None or group is tdist.group.WORLD:
            return "device"
        control = getattr(distributed, "control_group", lambda: None)()  # None before the control channel
        return "control" if group is control else "other"

    def record(kind: str, tensor, peer: int, group) -> None:
        log.write(json.dumps({"rank": rank, "kind": kind, "peer": int(peer), "group": label(group),
                              "dtype": str(tensor.dtype), "numel": tensor.numel()}) + "\n")

    def wrap(fn, kind: str):
        def recorded(tensor, peer=None, group=None, tag=0, **kwargs):
            record(kind, tensor, peer, group)
            return fn(tensor, peer, group, tag, **kwargs)
        return recorded

    def batched(ops):
        for op in ops:
            record("send" if op.op in (tdist.isend, _ORIGINAL["isend"]) else "recv", op.tensor, op.peer, op.group)
        return _ORIGINAL["batch_isend_irecv"](ops)

    for name, kind in (("isend", "send"), ("send", "send"), ("irecv", "recv"), ("recv", "recv")):
        _ORIGINAL.setdefault(name, getattr(tdist, name))
        setattr(tdist, name, wrap(_ORIGINAL[name], kind))
    _ORIGINAL.setdefault("batch_isend_irecv", tdist.batch_isend_irecv)
    tdist.batch_isend_irecv = batched


_ORIGINAL: dict = {}


def load(directory: str | os.PathLike) -> dict[int, list[Op]]:
    """Every rank's recorded ops, in posting order."""
    ops: dict[int, list[Op]] = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        rows = [Op(**json.loads(line)) for line in path.read_text().splitlines() if line]
        ops[int(path.stem[4:])] = rows
    return ops


def nccl_deadlocks(ops: dict[int, list[Op]]) -> list[str]:
    """Replay the device-group ops of every pair of ranks under NCCL's rule (module doc); one
    line per pair that cannot finish, naming the two ops that block each other."""
    queues: dict[tuple[int, int], deque] = defaultdict(deque)  # (rank, peer) -> that rank's ops to peer
    for rank, rows in ops.items():
        for op in rows:
            if op.group == "device":
                queues[rank, op.peer].append(op)
    stuck = []
    for a, b in sorted({tuple(sorted(pair)) for pair in queues}):
        mine, theirs, k = queues[a, b], queues[b, a], 0
        while mine and theirs and mine[0].matches(theirs[0]):  # the heads pair up: both advance
            mine.popleft(), theirs.popleft()
            k += 1
        if mine or theirs:
            heads = [f"rank {q[0].rank} waits in {q[0].kind} of {q[0].numel} x {q[0].dtype} with rank {q[0].peer}"
                     if q else f"rank {r} has nothing more to post to rank {o}" for q, r, o in ((mine, a, b),
                                                                                           (theirs, b, a))]
            stuck.append(f"ranks {a} and {b} deadlock at their op #{k} on the device group: " + "; ".join(heads))
    return stuck


def flow_violations(ops: dict[int, list[Op]], senders: set[int]) -> list[str]:
    """Device-group ops that break the one-way flow ``senders`` (target ranks) -> the others:
    a receive by a sender, a send by a receiver, or any op between two ranks of one side."""
    bad = []
    for rank, rows in ops.items():
        for i, op in enumerate(rows):
            if op.group != "device":
                continue
            forward = (op.kind == "send" and rank in senders and op.peer not in senders) or \
                      (op.kind == "recv" and rank not in senders and op.peer in senders)
            if not forward:
                bad.append(f"rank {rank} op #{i}: {op.kind} with rank {op.peer} on the device group "
                           f"({op.numel} x {op.dtype}) runs against the flow target -> drafter")
    return bad


def assert_one_way_and_nccl_safe(directory: str | os.PathLike, senders: set[int]) -> dict[int, list[Op]]:
    """The recorded job's device-group ops flow one way and finish under NCCL's rule; returns them."""
    ops = load(directory)
    assert ops, f"no p2p ops recorded in {directory}"
    problems = nccl_deadlocks(ops) + flow_violations(ops, senders)
    assert not problems, "\n".join(problems[:10])
    return ops
