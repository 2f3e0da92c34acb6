"""Process topology and collectives: the only module that touches torch.distributed state.

One code path for 1 and N processes: ``init_distributed`` reads the environment torchrun sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and creates a process group only when
WORLD_SIZE > 1 -- NCCL on CUDA, gloo on CPU. Every helper here (``barrier``, ``all_reduce``,
``broadcast_object``, ``gather_object``, ``all_gather_object``) is a no-op or the identity when
no process group exists, so callers never branch on world size.

Roles (``num_target_ranks > 0``, disaggregated placement, docs/pipeline.md): the first
``world - num_target_ranks`` ranks are drafter ranks, the last ``num_target_ranks`` target
ranks. Each role gets its own process group, and every helper above runs in THIS rank's role
group: drafter ranks see a world of the drafter ranks only (``Dist.rank`` / ``world_size``,
``get_rank()``, DDP via ``group()``, checkpoints), so the trainer's collectives never wait on
a target rank. Target ranks feed their drafter ranks point-to-point (global ranks) on two
channels (docs/distributed.md):

- the data channel, the default (device) group -- NCCL on CUDA: ``isend`` / ``irecv``, the
  feature tensors alone, flowing one way (target -> drafter: a target rank only sends, a drafter
  rank only receives). NCCL runs the un-batched point-to-point ops between two ranks in posting
  order on one stream, so a receive a sender posted ahead of its sends would hold them all back.
- the control channel, a gloo group over the same ranks (``control_isend`` / ``control_irecv``,
  host tensors): HELLO, step headers, DONE / STOP / END / ABORT. gloo matches a pair's messages
  by tag, not by stream order, so a long-lived receive there never blocks anything else.

Tensor-parallel targets (``tensor_parallel`` T > 1): the ranks that run the target (all of
them colocated; the target ranks disaggregated) form a mesh [data, tensor] of shape
(ranks / T, T), row-major, so ranks ``d*T .. d*T + T-1`` of them are target group d
(consecutive: one node's GPUs for T <= GPUs per node). ``Dist.data_rank`` /
``data_world_size`` index the groups (colocated, each group reads one data-parallel share of
the batch plan), ``Dist.tensor_rank`` a rank inside its group; ``target_mesh()`` holds the
meshes transformers shards the target over, ``target_group()`` the group's process group. The
drafter still trains data-parallel over every drafter rank.

Start-up (``startup_barrier``): loading the target from shared storage, converting the data
and checking a checkpoint take each rank a different time, often far longer than a step's
collective may wait. Every rank therefore meets the others at a host-side barrier on a gloo
group of its own, with its own (long) ``startup_timeout_s``, before the first device
collective; a rank that never arrives fails the job there with :class:`StartupError`, naming
it and what the ranks were doing.

Failure contract: the process group is created with ``timeout_s``. When a peer dies or hangs,
a collective on a live rank raises :class:`CollectiveError` (naming the operation, the rank
and the timeout) instead of blocking forever. With gloo the timeout is enforced per
operation; with NCCL the watchdog aborts the communicator after the timeout (PyTorch's
default TORCH_NCCL_ASYNC_ERROR_HANDLING=3 then tears the process down, which torchrun sees).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as tdist

from flashdraft.config import DEVICES

ReduceOpName = Literal["mean", "sum", "max", "min"]


class CollectiveError(RuntimeError):
    """A collective failed, typically because a peer rank died, hung or timed out."""


class StartupError(CollectiveError):
    """A rank did not join the job or reach a start-up barrier within its timeout, or died before
    it; the message says which, and where to look."""

    names_the_fix = True  # the command line reports it as one line (cli.entry)


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``backend`` is None when no process group exists."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    timeout_s: float = 600.0
    role: Literal["both", "drafter", "target"] = "both"  # both: colocated; else disaggregated
    global_rank: int = 0  # rank in the whole job (rank / world_size are within the role's group)
    peers: tuple[int, ...] = ()  # global ranks of the other role this rank talks to (disaggregated)
    tensor_size: int = 1  # ranks per target group: the target's tensor-parallel size

    @property
    def tensor_rank(self) -> int:
        """This rank's place in its target group."""
        return self.rank % self.tensor_size

    @property
    def data_rank(self) -> int:
        """This rank's target group: its share of the batch plan."""
        return self.rank // self.tensor_size

    @property
    def data_world_size(self) -> int:
        """Target groups in the job (data-parallel shares of the batch plan)."""
        return self.world_size // self.tensor_size

    @property
    def is_main(self) -> bool:
        """True on the rank that writes files and logs (rank 0 of the drafter ranks)."""
        return self.rank == 0 and self.role != "target"


# The process-wide topology. Set by init_distributed, reset by teardown; a default single
# CPU process until then, so library code may query it without initialising anything.
_STATE: Dist | None = None
# This rank's role group (disaggregated placement), which every helper runs in; None: the world.
_GROUP: Any = None
# Tensor-parallel targets: (the dense and the expert mesh transformers shards over); None when
# the target is not sharded.
_TARGET_MESH: Any = None
# Disaggregated placement: the gloo group over the whole job that carries the feature links'
# control messages (module doc); None otherwise. Its own group, not the start-up group: a control
# receive stays posted for the whole run, and must never match another protocol's message.
_CONTROL: Any = None
# The start-up group: gloo over the whole job with the start-up timeout (startup_barrier).
_STARTUP: Any = None
# This rank's role group on gloo with the start-up timeout (host_broadcast_object): the start-up
# group itself when colocated.
_HOST: Any = None
_STARTUP_TIMEOUT_S = 3600.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; launch with torchrun") from None


def _pick_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device_type='cuda' but no CUDA device is visible; use device_type='cpu' or 'auto'")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible on this node; "
                f"use torchrun --nproc-per-node={count} or fix CUDA_VISIBLE_DEVICES"
            )
        return torch.device("cuda", local_rank)
    raise ValueError(f"device_type={device_type!r} is invalid: use {', '.join(DEVICES[:-1])} or {DEVICES[-1]}")


def role_layout(world_size: int, num_target_ranks: int, tensor_parallel: int = 1) -> tuple[list[int], list[int]]:
    """(drafter ranks, target ranks) of a disaggregated job. The target ranks form feeders:
    each target rank, or with a tensor-parallel target each group of ``tensor_parallel``
    consecutive target ranks, feeds ``(world - T) / feeders`` consecutive drafter ranks (_peers).
    ValueError naming the fix."""
    num_drafter = world_size - num_target_ranks
    feeders = num_target_ranks // tensor_parallel
    if num_drafter < 1 or num_drafter % feeders:
        what = "target_ranks" if tensor_parallel == 1 else f"the target groups (target_ranks / {tensor_parallel})"
        raise ValueError(
            f"pipeline.placement=disaggregated with pipeline.target_ranks={num_target_ranks} "
            f"on WORLD_SIZE={world_size}: "
            f"the drafter ranks (world - target_ranks = {num_drafter}) must be a positive multiple of {what}; "
            f"launch e.g. torchrun --nproc-per-node={num_target_ranks + feeders} (one drafter rank per "
            f"{'target rank' if tensor_parallel == 1 else 'group'}) or change pipeline.target_ranks"
        )
    return list(range(num_drafter)), list(range(num_drafter, world_size))


def _peers(rank: int, drafters: list[int], targets: list[int], tensor_parallel: int = 1) -> tuple[int, ...]:
    """Who this rank talks to point-to-point: a drafter rank its feeder's first target rank; a
    feeder's first rank its drafter ranks; another rank of a target group nobody (it computes
    the features with its group, its first rank sends them)."""
    feeders = len(targets) // tensor_parallel
    per_feeder = len(drafters) // feeders
    if rank in drafters:
        return (targets[rank // per_feeder * tensor_parallel],)
    t = targets.index(rank)
    if t % tensor_parallel:
        return ()
    g = t // tensor_parallel
    return tuple(drafters[g * per_feeder : (g + 1) * per_feeder])


def init_distributed(device_type: str = "auto", timeout_s: float = 600.0, num_target_ranks: int = 0,
                     tensor_parallel: int = 1, startup_timeout_s: float = 3600.0) -> Dist:
    """Read the torchrun environment, pick the device and (when WORLD_SIZE > 1) join the group.

    ``device_type``: "auto" (CUDA when available, else CPU), "cuda" or "cpu". On CUDA this
    process uses ``cuda:LOCAL_RANK`` and calls ``torch.cuda.set_device`` so NCCL and default
    allocations land on it. ``timeout_s`` bounds every collective (see module doc).
    Idempotent: a second call returns the existing topology. Blocks until all WORLD_SIZE
    ranks have joined the rendezvous (or ``timeout_s`` passes). ``num_target_ranks > 0``
    splits the job into drafter and target roles (module doc); it needs WORLD_SIZE > 1.
    ``tensor_parallel`` > 1 groups the ranks into target groups of that many (module doc).
    ``startup_timeout_s`` bounds each ``startup_barrier`` (module doc).
    """
    global _STATE, _GROUP, _CONTROL, _HOST
    if _STATE is not None:
        return _STATE
    if timeout_s <= 0 or startup_timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}, startup_timeout_s={startup_timeout_s}: use positive numbers of "
                         "seconds")
    world_size = _env_int("WORLD_SIZE", 1)
    sharded_ranks = num_target_ranks or world_size  # the ranks that run the target
    if tensor_parallel > 1 and sharded_ranks % tensor_parallel:
        raise ValueError(
            f"model.tensor_parallel={tensor_parallel} with "
            + (f"pipeline.target_ranks={num_target_ranks}: the target ranks must be a multiple of it, e.g. "
               f"pipeline.target_ranks={tensor_parallel}" if num_target_ranks else
               f"WORLD_SIZE={world_size}: the world must be a multiple of it; launch e.g. torchrun "
               f"--nproc-per-node={tensor_parallel}")
        )
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world_size} is inconsistent; launch with torchrun")
    device = _pick_device(device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = _join(device, rank, world_size, timeout_s, startup_timeout_s) if world_size > 1 else None
    if num_target_ranks == 0:
        if tensor_parallel > 1:
            _make_target_mesh(device, backend, list(range(world_size)), tensor_parallel, timeout_s)
        _STATE = Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend,
                      timeout_s=float(timeout_s), global_rank=rank, tensor_size=tensor_parallel)
        return _STATE
    if world_size == 1:
        raise ValueError("pipeline.placement=disaggregated needs separate target and drafter processes: launch with "
                         "torchrun --nproc-per-node=2 or more (docs/pipeline.md), or use pipeline.placement=colocated")
    drafters, targets = role_layout(world_size, num_target_ranks, tensor_parallel)
    # new_group is collective over the whole world: every rank creates both groups, in this order.
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = {"drafter": tdist.new_group(drafters, timeout=timeout),
              "target": tdist.new_group(targets, timeout=timeout)}
    # The links' control channel: gloo whatever the device backend (module doc), the job's timeout.
    _CONTROL = tdist.new_group(list(range(world_size)), timeout=timeout, backend="gloo")
    if tensor_parallel > 1:  # also collective over the world: drafter ranks take part, outside the mesh
        _make_target_mesh(device, backend, targets, tensor_parallel, timeout_s)
    role = "drafter" if rank in drafters else "target"
    members = drafters if role == "drafter" else targets
    _GROUP = groups[role]
    startup = datetime.timedelta(seconds=startup_timeout_s)
    host = {"drafter": tdist.new_group(drafters, backend="gloo", timeout=startup),
            "target": tdist.new_group(targets, backend="gloo", timeout=startup)}
    _HOST = host[role]
    _STATE = Dist(rank=members.index(rank), world_size=len(members), local_rank=local_rank, device=device,
                  backend=backend, timeout_s=float(timeout_s), role=role, global_rank=rank,
                  peers=_peers(rank, drafters, targets, tensor_parallel),
                  tensor_size=tensor_parallel if role == "target" else 1)
    return _STATE


def _join(device: torch.device, rank: int, world_size: int, timeout_s: float, startup_timeout_s: float) -> str:
    """Join the job's process group (NCCL on CUDA, else gloo), then create the gloo start-up group
    (first, in the same order on every rank: new_group is collective over the world). Returns the
    backend."""
    global _STARTUP, _STARTUP_TIMEOUT_S, _HOST
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world_size} but {', '.join(missing)} unset; launch with torchrun "
                         "(docs/distributed.md)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds the communicator to this GPU eagerly
    begin = time.monotonic()
    try:
        tdist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size,
                                 timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except RuntimeError as exc:  # the store's own error (DistStoreError, DistNetworkError): said with the fix
        raise StartupError(
            f"rank {rank} of {world_size} could not join the job at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} within {time.monotonic() - begin:.0f} s ({str(exc).splitlines()[0]}): "
            f"every rank must start and join within train.collective_timeout_s={timeout_s:g} s. One did not: it died "
            "before joining (check its log for the first error) or was launched with another MASTER_ADDR, "
            "MASTER_PORT or WORLD_SIZE") from exc
    _STARTUP = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=startup_timeout_s))
    _STARTUP_TIMEOUT_S = float(startup_timeout_s)
    _HOST = _STARTUP
    return backend


def _make_target_mesh(device: torch.device, backend: str, ranks: list[int], tensor_parallel: int,
                      timeout_s: float) -> None:
    """The meshes transformers shards a tensor-parallel target over, on the target ranks
    ``ranks`` (global, consecutive; collective: every rank of the job takes part). Dense layers
    on (pp, dp_replicate, fsdp, tp) = (1, G, 1, T), experts on (pp, dp_replicate, efsdp, ep) =
    (1, G, 1, T): expert parallelism inside the target group, as wide as it. The groups get the
    job's collective timeout (a new group's default is torch's 30 minutes), so a rank of a target
    group that hangs fails the others in ``timeout_s``."""
    global _TARGET_MESH
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.tensor(ranks).view(1, len(ranks) // tensor_parallel, 1, tensor_parallel)
    options = _group_options(backend, datetime.timedelta(seconds=timeout_s))
    meshes = [DeviceMesh(device.type, layout, mesh_dim_names=names, backend_override=((backend, options),) * 4)
              for names in (("pp", "dp_replicate", "fsdp", "tp"), ("pp", "dp_replicate", "efsdp", "ep"))]
    _TARGET_MESH = tuple(meshes)


def _group_options(backend: str, timeout: datetime.timedelta) -> Any:
    """A new group's backend options carrying ``timeout``: NCCL takes only its own options type
    (ProcessGroupNCCL.Options), gloo the generic one."""
    from torch._C import _distributed_c10d as c10d

    if backend == "nccl":
        options = c10d.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return c10d.Backend.Options(backend, timeout)


def target_mesh() -> tuple[Any, Any] | None:
    """(dense mesh, expert mesh) of a tensor-parallel target (module doc); None when unsharded."""
    return _TARGET_MESH


def target_group() -> Any:
    """The process group of this rank's target group (tensor-parallel targets), else None (no
    sharded target, or a disaggregated drafter rank: outside the mesh)."""
    if _TARGET_MESH is None or _TARGET_MESH[0].get_coordinate() is None:
        return None
    return _TARGET_MESH[0].get_group("tp")


def group() -> Any:
    """This rank's role group for collectives (DDP's ``process_group``); None: the default group."""
    return _GROUP


def get_dist() -> Dist:
    """The current topology: what init_distributed returned, else a single CPU process."""
    if _STATE is not None:
        return _STATE
    if _active():  # a group created outside init_distributed (e.g. by a test harness)
        return Dist(rank=tdist.get_rank(), world_size=tdist.get_world_size(), backend=tdist.get_backend(),
                    global_rank=tdist.get_rank())
    return Dist()


def get_rank() -> int:
    """This rank within its role group (the world when colocated)."""
    return tdist.get_rank(_GROUP) if _active() else 0


def get_world_size() -> int:
    """Ranks in this rank's role group (the world when colocated)."""
    return tdist.get_world_size(_GROUP) if _active() else 1


def teardown() -> None:
    """Leave the process group (if any) and forget the topology. Safe to call twice."""
    global _STATE, _GROUP, _TARGET_MESH, _CONTROL, _STARTUP, _HOST
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    _STATE = _GROUP = _TARGET_MESH = _CONTROL = _STARTUP = _HOST = None


def _active() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size(_GROUP) > 1


def _fail(op: str, exc: BaseException) -> CollectiveError:
    d = get_dist()
    return CollectiveError(
        f"{op} failed on rank {d.rank}/{d.world_size} (collective timeout {d.timeout_s:g} s): {exc}. "
        "A peer rank probably died or hung -- check the other ranks' logs for the first error."
    )


def barrier() -> None:
    """Block until every rank arrives. Host sync. No-op at world size 1."""
    if not _active():
        return
    try:
        if get_dist().backend == "nccl":
            tdist.barrier(group=_GROUP, device_ids=[torch.cuda.current_device()])
        else:
            tdist.barrier(group=_GROUP)
    except RuntimeError as exc:
        raise _fail("barrier", exc) from exc


def startup_timeout_s() -> float:
    """train.startup_timeout_s as the job was started with: how long start-up waits may take."""
    return _STARTUP_TIMEOUT_S


def startup_barrier(what: str) -> None:
    """Block until every rank of the job (both roles) has finished ``what`` (e.g. "loading the
    target and the data"), waiting up to the start-up timeout instead of the collective one:
    host-side, on the gloo start-up group, so no device collective (DDP's first broadcast, a
    step's all-reduce) starts while a rank is still reading from shared storage. Raises
    :class:`StartupError` naming the ranks that did not arrive (on rank 0) or the barrier (on
    the others). No-op without a process group."""
    if _STARTUP is None:
        return
    timeout = datetime.timedelta(seconds=_STARTUP_TIMEOUT_S)
    begin = time.monotonic()
    try:
        # monitored: rank 0 collects every rank's arrival and names the missing ones
        tdist.monitored_barrier(group=_STARTUP, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        waited = time.monotonic() - begin
        if waited < 0.9 * _STARTUP_TIMEOUT_S:  # failed long before the timeout: a peer's connection closed
            raise StartupError(
                f"start-up barrier after {what}: rank {tdist.get_rank()} of {tdist.get_world_size()} lost a peer "
                f"after {waited:.1f} s, long before train.startup_timeout_s={_STARTUP_TIMEOUT_S:g} s ({exc}): a rank "
                "died during start-up; its log has the first error") from exc
        raise StartupError(
            f"start-up barrier after {what}: rank {tdist.get_rank()} of {tdist.get_world_size()} waited "
            f"train.startup_timeout_s={_STARTUP_TIMEOUT_S:g} s and the others did not all arrive ({exc}). A rank "
            "is slower than that (a slow shared filesystem: raise train.startup_timeout_s) or died (check its "
            "log for the first error)") from exc


@contextlib.contextmanager
def collective_errors(op: str):
    """Turn a torch.distributed failure inside the block (e.g. DDP's all-reduce in backward)
    into :class:`CollectiveError` naming ``op``. Other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as exc:
        # DDP's reducer re-raises gloo/NCCL failures as plain RuntimeError; recognise them by the
        # backend's wording so that real bugs (shape errors, OOM) are never relabelled.
        if not _active() or not (isinstance(exc, tdist.DistError) or _COMM_FAILURE.search(str(exc))):
            raise
        raise _fail(op, exc) from exc


_COMM_FAILURE = re.compile(r"gloo|nccl|connection (reset|closed|refused)|timed out|ProcessGroup", re.IGNORECASE)


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def target_group_max(tensor: torch.Tensor) -> torch.Tensor:
    """Elementwise max of ``tensor`` over this rank's target group (tensor-parallel targets: its
    ranks agree on a decision, e.g. whether to stop); the identity without one. Host sync."""
    group = target_group()
    if group is None:
        return tensor
    try:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:
        raise _fail("all_reduce(max) over the target group", exc) from exc
    return tensor


def target_group_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` of the target group's first rank, on every rank of the group (in place)."""
    group = target_group()
    if group is None:
        return tensor
    try:
        tdist.broadcast(tensor, group=group, group_src=0)
    except RuntimeError as exc:
        raise _fail("broadcast over the target group", exc) from exc
    return tensor


def all_reduce(tensor: torch.Tensor, op: ReduceOpName = "mean") -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it. Identity at world size 1.

    Enqueued on the current stream without a host sync on CUDA (the host waits only when the
    result is read). "mean" divides the sum by the world size (gloo has no AVG op).
    """
    if op not in ("mean", "sum", "max", "min"):
        raise ValueError(f"op={op!r} is invalid: use mean, sum, max or min")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"all_reduce(op='mean') needs a floating-point tensor, got {tensor.dtype}; use op='sum'")
    if not _active():
        return tensor
    try:
        if op == "mean":
            if get_dist().backend == "nccl":
                tdist.all_reduce(tensor, op=tdist.ReduceOp.AVG, group=_GROUP)
            else:
                tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM, group=_GROUP)
                tensor.div_(get_world_size())
        else:
            tdist.all_reduce(tensor, op=getattr(tdist.ReduceOp, _OPS[op]), group=_GROUP)
    except RuntimeError as exc:
        raise _fail(f"all_reduce({op})", exc) from exc
    return tensor


# Object collectives pickle in memory between our own ranks (never from disk). They are for
# small control data (decisions, RNG states, counters); tensors of real size go through
# all_reduce.

def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` (rank within the role group) on every rank. Host sync. Identity at world size 1."""
    if not _active():
        return obj
    box = [obj]
    try:
        tdist.broadcast_object_list(box, group=_GROUP, group_src=src)
    except RuntimeError as exc:
        raise _fail("broadcast_object", exc) from exc
    return box[0]


def host_broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (rank within the role group) on every rank of the role, through host
    memory on gloo with the start-up timeout: for start-up data too big for the device or too
    slow to read for the collective timeout (a resumed checkpoint's replicated parts). Host
    sync. Identity without a process group; on a group made outside init_distributed (a test
    harness's), ``broadcast_object``."""
    if not _active():
        return obj
    box = [obj]
    try:
        tdist.broadcast_object_list(box, group=_HOST if _HOST is not None else _GROUP, group_src=0)
    except RuntimeError as exc:
        raise _fail("host_broadcast_object", exc) from exc
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, indexed by rank, on every rank. Host sync. ``[obj]`` at world 1."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    try:
        tdist.all_gather_object(out, obj, group=_GROUP)
    except RuntimeError as exc:
        raise _fail("all_gather_object", exc) from exc
    return out


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj``, indexed by rank, on rank ``dst``; None elsewhere. Host sync.

    ``[obj]`` at world size 1.
    """
    if not _active():
        return [obj]
    out: list[Any] | None = [None] * get_world_size() if get_rank() == dst else None
    try:
        tdist.gather_object(obj, out, group=_GROUP, group_dst=dst)
    except RuntimeError as exc:
        raise _fail("gather_object", exc) from exc
    return out


# ---- point-to-point (disaggregated placement) ------------------------------------------------


class Transfer:
    """A pending ``isend`` / ``irecv``. ``done()`` polls; ``wait()`` blocks until it completed,
    at most the process group's timeout, and turns a failure (a dead peer closes the
    connection: noticed at once on gloo) into :class:`CollectiveError`."""

    def __init__(self, work: Any, op: str):
        self._work, self.op = work, op
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._work.is_completed()

    def wait(self, timeout_s: float | None = None) -> None:
        """Idempotent (a second wait on a gloo receive would wait for another message). Waits at
        most ``timeout_s`` (default: the job's collective timeout)."""
        if self._finished:
            return
        try:
            # gloo's point-to-point ops ignore the group's timeout unless wait() is given one
            self._work.wait(datetime.timedelta(seconds=timeout_s or get_dist().timeout_s))
        except RuntimeError as exc:
            raise _fail(self.op, exc) from exc
        self._finished = True

    def wait_unbounded(self) -> None:
        """Block until completed, however long: for a receive that stays posted for a whole run,
        waited on by a watcher thread (``feed.flow.Watcher``) while its owner polls the watcher.
        gloo reports a point-to-point op's completion only to a wait (``done()`` stays False
        until then), and a wait whose timeout expires closes the connection; a dead peer still
        fails this one (its connection closes). Only the watcher may wait on this transfer."""
        if self._finished:
            return
        try:
            self._work.wait()
        except RuntimeError as exc:
            raise _fail(self.op, exc) from exc
        self._finished = True


def control_group() -> Any:
    """The gloo group carrying the feature links' control messages (disaggregated placement);
    None otherwise."""
    return _CONTROL


def isend(tensor: torch.Tensor, dst: int) -> Transfer:
    """Start sending ``tensor`` to GLOBAL rank ``dst`` on the data channel (the device group);
    keep it unchanged until ``wait()``. Messages between two ranks arrive in the order they were
    sent. Only ever from the sending side of a one-way flow: under NCCL a pair's ops run in
    posting order on one stream, so an op against the flow would stall the flow (module doc)."""
    try:
        return Transfer(tdist.isend(tensor, dst), f"send to rank {dst}")
    except RuntimeError as exc:
        raise _fail(f"send to rank {dst}", exc) from exc


def irecv(tensor: torch.Tensor, src: int) -> Transfer:
    """Start receiving into ``tensor`` (its shape and dtype must match the sender's) from
    GLOBAL rank ``src`` on the data channel (the device group): the receiving side of a
    one-way flow only (see ``isend``)."""
    try:
        return Transfer(tdist.irecv(tensor, src), f"receive from rank {src}")
    except RuntimeError as exc:
        raise _fail(f"receive from rank {src}", exc) from exc


def control_isend(tensor: torch.Tensor, dst: int) -> Transfer:
    """Start sending the host tensor ``tensor`` to GLOBAL rank ``dst`` on the control channel
    (gloo: its receives, however long-lived, never hold back the data channel)."""
    try:
        return Transfer(tdist.isend(_host(tensor), dst, group=_control()), f"control send to rank {dst}")
    except RuntimeError as exc:
        raise _fail(f"control send to rank {dst}", exc) from exc


def control_irecv(tensor: torch.Tensor, src: int) -> Transfer:
    """Start receiving into the host tensor ``tensor`` from GLOBAL rank ``src`` on the control
    channel. May stay posted for the whole run (e.g. a drafter rank's STOP)."""
    try:
        return Transfer(tdist.irecv(_host(tensor), src, group=_control()), f"control receive from rank {src}")
    except RuntimeError as exc:
        raise _fail(f"control receive from rank {src}", exc) from exc


def _control() -> Any:
    if _CONTROL is None:
        raise RuntimeError("no control channel: it exists in a disaggregated job only (init_distributed with "
                           "num_target_ranks > 0)")
    return _CONTROL


def _host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ValueError(f"the control channel (gloo) carries host tensors; got one on {tensor.device}")
    return tensor
