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

A clock for every wait (:class:`Clocks`): each wait of a job is bounded by the clock of what it
waits for -- a step's collective, start-up, a drafter rank's pause (a checkpoint save, an eval),
a feature link's send, a receive posted for the whole run -- never by the collective timeout
by accident. A wait that outlasts a step (a pause, start-up) is host-side, on gloo, where each
wait carries its own timeout; a device group carries only waits its own timeout bounds, since
NCCL's watchdog applies a group's timeout to every op posted on it, whatever ``wait()`` is told.

Failure contract: when a peer dies or hangs, a wait on a live rank raises
:class:`CollectiveError` (naming the operation, the rank, its clock and the config field that
sets it) instead of blocking forever. With gloo the timeout is enforced per wait, and a dead
peer fails a pending wait at once (its connection closes); with NCCL the watchdog aborts the
communicator after the group's timeout (PyTorch's default TORCH_NCCL_ASYNC_ERROR_HANDLING=3
then tears the process down, which torchrun sees).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as tdist

from flashdraft.config import DEVICES

ReduceOpName = Literal["mean", "sum", "max", "min"]
Wait = Literal["collective", "startup", "pause", "link", "watch"]

# A receive posted for the whole run (a feature link's DONE / STOP / ABORT) must still be waited
# with a finite clock: gloo gives a wait told no timeout the group's, and an expired wait closes
# every connection of the group. A year outlasts any run; a dead peer fails the wait at once.
WATCH_S = 365 * 86400.0


@dataclass(frozen=True)
class Clocks:
    """How long each kind of wait of a job may last (docs/distributed.md, "A clock for every
    wait"): ``seconds(wait)``, and ``knob(wait)`` the config field(s) that set it.

    - ``collective``: a step's collectives, and a feature link's receives (the target rank sends
      each step as soon as it is computed): every rank gets there within a step, so only a dead
      or hung peer makes one wait longer. train.collective_timeout_s.
    - ``startup``: start-up, where each rank reads shared storage at its own pace: the start-up
      barrier, a sharded target's first gather, a link's HELLO (sent once the drafter rank has
      resumed), the resume's broadcast of the checkpoint. train.startup_timeout_s.
    - ``pause``: a drafter rank's pause between two steps, which the other ranks of its role
      wait for: rank 0's checkpoint save (write, fsync, hash, export) or an eval.
      train.pause_timeout_s.
    - ``link``: a feature link's send, which completes only when its drafter rank takes it: a
      step, plus the pause that drafter rank may be in (collective + pause). It is also the
      timeout of every device group whose ops a pending send can hold up (a disaggregated job's
      data channel, its target groups' meshes), since NCCL's watchdog times the ops posted there.
    - ``watch``: a receive posted for the whole run (``WATCH_S``); a dead peer still fails it at once.
    """

    collective_s: float = 600.0
    startup_s: float = 3600.0
    pause_s: float = 3600.0

    def __post_init__(self):
        if min(self.collective_s, self.startup_s, self.pause_s) <= 0:
            raise ValueError(f"clocks {self}: use positive numbers of seconds")

    def seconds(self, wait: Wait) -> float:
        return {"collective": self.collective_s, "startup": self.startup_s, "pause": self.pause_s,
                "link": self.collective_s + self.pause_s, "watch": WATCH_S}[wait]

    @staticmethod
    def knob(wait: Wait) -> str:
        """What sets the clock of ``wait``, for error messages."""
        return {"collective": "train.collective_timeout_s", "startup": "train.startup_timeout_s",
                "pause": "train.pause_timeout_s",
                "link": "train.collective_timeout_s + train.pause_timeout_s",
                "watch": "flashdraft.distributed.WATCH_S"}[wait]

    def describe(self, wait: Wait) -> str:
        """E.g. "train.pause_timeout_s = 3600 s"."""
        return f"{self.knob(wait)} = {self.seconds(wait):g} s"


class CollectiveError(RuntimeError):
    """A collective failed, typically because a peer rank died, hung or timed out."""


class StartupError(CollectiveError):
    """A rank did not join the job or reach a start-up barrier within its timeout, or died before
    it; the message says which, and where to look."""

    names_the_fix = True  # the command line reports it as one line (cli.entry)


class GlooAddressError(StartupError):
    """A multi-node job's gloo groups would bind an address the other nodes cannot reach (a
    hostname that resolves to a loopback address, a management NIC): the message names the
    address, where it came from and GLOO_SOCKET_IFNAME."""

    names_the_fix = True  # the command line reports it as one line (cli.entry)


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``backend`` is None when no process group exists."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    clocks: Clocks = field(default_factory=Clocks)  # how long each kind of wait may last
    role: Literal["both", "drafter", "target"] = "both"  # both: colocated; else disaggregated
    global_rank: int = 0  # rank in the whole job (rank / world_size are within the role's group)
    peers: tuple[int, ...] = ()  # global ranks of the other role this rank talks to (disaggregated)
    tensor_size: int = 1  # ranks per target group: the target's tensor-parallel size
    job_world_size: int = 1  # ranks in the whole job (both roles)

    @property
    def timeout_s(self) -> float:
        """The collective timeout (train.collective_timeout_s)."""
        return self.clocks.collective_s

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
# the target is not sharded. _MESH_WAIT: the clock its groups were made with.
_TARGET_MESH: Any = None
_MESH_WAIT: Wait = "collective"
# Disaggregated placement: the gloo group over the whole job that carries the feature links'
# control messages (module doc); None otherwise. Its own group, not the start-up group: a control
# receive stays posted for the whole run, and must never match another protocol's message.
_CONTROL: Any = None
# The start-up group: gloo over the whole job with the start-up timeout (startup_barrier).
_STARTUP: Any = None
_STARTUP_SINCE = 0.0  # when this rank's start-up group was made: no rank waits in it from earlier
# This rank's role group on gloo with the start-up timeout (host_barrier, host_broadcast_*): the
# start-up group itself when colocated.
_HOST: Any = None
# The job's clocks, from the start of init_distributed (the groups are made with them).
_CLOCKS = Clocks()


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
                     tensor_parallel: int = 1, startup_timeout_s: float = 3600.0, pause_timeout_s: float = 3600.0
                     ) -> Dist:
    """Read the torchrun environment, pick the device and (when WORLD_SIZE > 1) join the group.

    ``device_type``: "auto" (CUDA when available, else CPU), "cuda" or "cpu". On CUDA this
    process uses ``cuda:LOCAL_RANK`` and calls ``torch.cuda.set_device`` so NCCL and default
    allocations land on it. ``timeout_s``, ``startup_timeout_s`` and ``pause_timeout_s`` are the
    job's clocks (:class:`Clocks`: collective, startup, pause), which every wait and group takes
    its timeout from. Idempotent: a second call returns the existing topology. Blocks until all
    WORLD_SIZE ranks have joined the rendezvous (or ``timeout_s`` passes). ``num_target_ranks > 0``
    splits the job into drafter and target roles (module doc); it needs WORLD_SIZE > 1.
    ``tensor_parallel`` > 1 groups the ranks into target groups of that many (module doc).
    """
    global _STATE, _GROUP, _CONTROL, _HOST, _CLOCKS
    if _STATE is not None:
        return _STATE
    clocks = Clocks(float(timeout_s), float(startup_timeout_s), float(pause_timeout_s))
    world_size = _env_int("WORLD_SIZE", 1)
    sharded_ranks = num_target_ranks or world_size  # the ranks that run the target
    if tensor_parallel > 1 and sharded_ranks % tensor_parallel:
        raise ValueError(
            f"target.tensor_parallel={tensor_parallel} with "
            + (f"pipeline.target_ranks={num_target_ranks}: the target ranks must be a multiple of it, e.g. "
               f"pipeline.target_ranks={tensor_parallel}" if num_target_ranks else
               f"WORLD_SIZE={world_size}: the world must be a multiple of it; launch e.g. torchrun "
               f"--nproc-per-node={tensor_parallel}")
        )
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world_size} is inconsistent; launch with torchrun")
    if num_target_ranks and world_size == 1:
        raise ValueError("pipeline.placement=disaggregated needs separate target and drafter processes: launch with "
                         "torchrun --nproc-per-node=2 or more (docs/pipeline.md), or use pipeline.placement=colocated")
    device = _pick_device(device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _CLOCKS = clocks
    # In a disaggregated job the default group carries only the data channel, whose sends wait for
    # a drafter rank's step and pause: its timeout is the link clock (NCCL's watchdog times them).
    backend = _join(device, rank, world_size, clocks, "link" if num_target_ranks else "collective") \
        if world_size > 1 else None
    if num_target_ranks == 0:
        if tensor_parallel > 1:
            _make_target_mesh(device, backend, list(range(world_size)), tensor_parallel, "collective")
        _STATE = Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend,
                      clocks=clocks, global_rank=rank, tensor_size=tensor_parallel, job_world_size=world_size)
        return _STATE
    drafters, targets = role_layout(world_size, num_target_ranks, tensor_parallel)
    # new_group is collective over the whole world: every rank creates both groups, in this order.
    collective = datetime.timedelta(seconds=clocks.collective_s)
    groups = {"drafter": tdist.new_group(drafters, timeout=collective),
              "target": tdist.new_group(targets, timeout=collective)}
    # The links' control channel: gloo whatever the device backend (module doc); each wait on it
    # carries its own clock (Transfer), the group's timeout is only gloo's default.
    _CONTROL = tdist.new_group(list(range(world_size)), timeout=collective, backend="gloo")
    if tensor_parallel > 1:  # also collective over the world: drafter ranks take part, outside the mesh
        # a target group's forward waits while its first rank's send waits for a paused drafter rank
        _make_target_mesh(device, backend, targets, tensor_parallel, "link")
    role = "drafter" if rank in drafters else "target"
    members = drafters if role == "drafter" else targets
    _GROUP = groups[role]
    startup = datetime.timedelta(seconds=clocks.startup_s)
    host = {"drafter": tdist.new_group(drafters, backend="gloo", timeout=startup),
            "target": tdist.new_group(targets, backend="gloo", timeout=startup)}
    _HOST = host[role]
    _STATE = Dist(rank=members.index(rank), world_size=len(members), local_rank=local_rank, device=device,
                  backend=backend, clocks=clocks, role=role, global_rank=rank,
                  peers=_peers(rank, drafters, targets, tensor_parallel),
                  tensor_size=tensor_parallel if role == "target" else 1, job_world_size=world_size)
    return _STATE


def _join(device: torch.device, rank: int, world_size: int, clocks: Clocks, default_wait: Wait) -> str:
    """Join the job's process group (NCCL on CUDA, else gloo) with the clock of ``default_wait``,
    then create the gloo start-up group (first, in the same order on every rank: new_group is
    collective over the world). Returns the backend."""
    global _STARTUP, _STARTUP_SINCE, _HOST
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world_size} but {', '.join(missing)} unset; launch with torchrun "
                         "(docs/distributed.md)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds the communicator to this GPU eagerly
    timeout = datetime.timedelta(seconds=clocks.seconds(default_wait))
    begin = time.monotonic()
    try:
        # torchrun's rendezvous, as init_process_group's env:// makes it: the store first, so that the
        # gloo addresses are checked before any gloo group (start-up, control, host: NCCL jobs too)
        # tries to connect to them, which fails only after its timeout, naming no cause
        store, _, _ = next(tdist.rendezvous("env://", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    except RuntimeError as exc:  # the store's own error (DistStoreError, DistNetworkError): said with the fix
        raise StartupError(
            f"rank {rank} of {world_size} could not join the job at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} within {time.monotonic() - begin:.0f} s ({str(exc).splitlines()[0]}): "
            f"every rank must start and join within {clocks.knob(default_wait)}={clocks.seconds(default_wait):g} s. "
            "One did not: it died before joining (check its log for the first error) or was launched with another "
            "MASTER_ADDR, MASTER_PORT or WORLD_SIZE") from exc
    # per attempt: torchrun's agent keeps its store over --max-restarts, with the last attempt's keys
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    check_gloo_addresses(tdist.PrefixStore(f"flashdraft/gloo/{attempt}", store), rank, world_size,
                         _env_int("LOCAL_WORLD_SIZE", world_size))
    tdist.init_process_group(backend=backend, store=tdist.PrefixStore("default_pg", store), rank=rank,
                             world_size=world_size, timeout=timeout, **kwargs)
    _STARTUP = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=clocks.startup_s))
    _STARTUP_SINCE = time.monotonic()
    _HOST = _STARTUP
    return backend


# ---- gloo's address on a multi-node job -----------------------------------------------------

# How long a TCP connect to another node's gloo address may take (a firewall that drops the
# packets is reported after this, not after the collective timeout).
GLOO_PROBE_S = 20.0
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _interface_ipv4(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux); OSError when it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def _interfaces() -> dict[str, str]:
    """Every network interface with an IPv4 address: name -> address (Linux)."""
    found = {}
    for _, name in socket.if_nameindex():
        with contextlib.suppress(OSError):
            found[name] = _interface_ipv4(name)
    return found


def gloo_address() -> tuple[str, str]:
    """(the address this process's gloo groups bind to, where it comes from), as torch's
    ProcessGroupGloo picks it: the first interface GLOO_SOCKET_IFNAME names, else the first
    address this machine's hostname resolves to that a socket can bind, else the loopback
    address. GlooAddressError when GLOO_SOCKET_IFNAME names an interface without an IPv4
    address."""
    named = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if named:
        try:
            return _interface_ipv4(named), f"GLOO_SOCKET_IFNAME={named}"
        except OSError as exc:
            raise GlooAddressError(
                f"GLOO_SOCKET_IFNAME={named}: this machine has no interface of that name with an IPv4 address "
                f"({exc}); set it to one of {', '.join(f'{k} ({v})' for k, v in _interfaces().items())}") from None
    host = socket.gethostname()
    try:
        candidates = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        candidates = []
    for family, kind, proto, _, address in candidates:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(address)
            except OSError:
                continue
        return address[0], f"the hostname {host!r} resolves to it"
    return "127.0.0.1", f"the hostname {host!r} resolves to no address of this machine: gloo falls back to loopback"


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def check_gloo_addresses(store: Any, rank: int, world_size: int, local_world_size: int) -> None:
    """Before any gloo group exists: on a job whose ranks run on several hosts, check that this
    rank's gloo address (``gloo_address``) is one the other hosts can reach. Every rank
    publishes its host and address in ``store`` and listens there; rank r probes rank
    (r + ``local_world_size``) mod ``world_size`` -- the same local rank on the next node, as
    torchrun numbers them -- when that rank runs on another host: a loopback address there is
    refused outright, any other must accept a TCP connection within ``GLOO_PROBE_S``. The probed
    rank learns the verdict through the store, so both ends of a bad pair raise
    :class:`GlooAddressError`, naming the address, where it came from, and GLOO_SOCKET_IFNAME
    (with the interfaces this machine has), once every rank holds its verdict
    (``_verdicts_read``). One connection per rank; single-host jobs (a loopback address is fine
    there) make none. Waits on the store under its clock (the collective one, or a disaggregated
    job's link clock)."""
    if sys.platform != "linux":  # the interface lookup is Linux's; multi-node GPU jobs run there
        return
    address, source = gloo_address()
    host = socket.gethostname()
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((address, 0))
        listener.listen(16)
        store.set(f"addr/{rank}", json.dumps([host, address, listener.getsockname()[1], source]))
        peer = (rank + local_world_size) % world_size
        peer_host, peer_address, peer_port, peer_source = json.loads(store.get(f"addr/{peer}"))
        verdict = ""
        if peer_host != host:
            verdict = _probe(peer_address, peer_port)
            if verdict:
                verdict = (f"rank {peer} (host {peer_host}) binds gloo to {peer_address} ({peer_source}), which rank "
                           f"{rank} on host {host} cannot reach: {verdict}")
        store.set(f"probe/{peer}", verdict)
        mine = store.get(f"probe/{rank}").decode()  # from the rank that probes this one
        _verdicts_read(store, rank, world_size, local_world_size)
    if verdict or mine:
        fix = ("set GLOO_SOCKET_IFNAME on every node to the interface its nodes reach each other through (this "
               f"machine has {', '.join(f'{k} ({v})' for k, v in _interfaces().items())}), or map each hostname to "
               "that interface's address in /etc/hosts. gloo carries the start-up barrier and a disaggregated job's "
               "control messages in NCCL jobs too (docs/distributed.md)")
        raise GlooAddressError(f"{'; '.join(v for v in (mine, verdict) if v)}; {fix}")


def _verdicts_read(store: Any, rank: int, world_size: int, local_world_size: int) -> None:
    """Return once every rank holds its gloo-address verdict; the ranks whose exit ends the
    store's host (rank 0, which hosts it; under torchrun node 0's ranks, whose agent hosts it and
    exits with them) return only after every other rank's last message, a ``set``, which waits for
    no reply. A bad address makes every rank raise at once: the host gone first left the others
    a raw "Failed to recv" instead of their GlooAddressError."""
    if store.add("read", 1) == world_size:
        store.set("read/all", "")
    store.wait(["read/all"])
    hosts = local_world_size if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 1
    if rank < hosts:
        store.wait([f"left/{r}" for r in range(hosts, world_size)])
    else:
        store.set(f"left/{rank}", "")


def _probe(address: str, port: int) -> str:
    """"" when a TCP connection to ``address``:``port`` opens within GLOO_PROBE_S, else why not."""
    if _is_loopback(address):
        return "a loopback address, which on another host is that host itself"
    try:
        with socket.create_connection((address, port), timeout=GLOO_PROBE_S):
            return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _make_target_mesh(device: torch.device, backend: str, ranks: list[int], tensor_parallel: int,
                      wait: Wait) -> None:
    """The meshes transformers shards a tensor-parallel target over, on the target ranks
    ``ranks`` (global, consecutive; collective: every rank of the job takes part). Dense layers
    on (pp, dp_replicate, fsdp, tp) = (1, G, 1, T), experts on (pp, dp_replicate, efsdp, ep) =
    (1, G, 1, T): expert parallelism inside the target group, as wide as it. The groups get the
    clock ``wait`` names (a new group's default is torch's 30 minutes), so a rank of a target
    group that hangs fails the others in that time: the collective clock, or in a disaggregated
    job the link clock (the group's forwards wait while its first rank's send waits for a paused
    drafter rank)."""
    global _TARGET_MESH, _MESH_WAIT
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.tensor(ranks).view(1, len(ranks) // tensor_parallel, 1, tensor_parallel)
    options = _group_options(backend, datetime.timedelta(seconds=_CLOCKS.seconds(wait)))
    _MESH_WAIT = wait
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


def group_timeouts() -> dict[str, float]:
    """The timeout, in seconds, of each process group this rank belongs to, by its use: what NCCL's
    watchdog applies to every op posted on it (the rule the clocks keep: a group's timeout bounds
    the longest wait posted there, module doc). Empty without a process group."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return {}
    groups = {"default": tdist.group.WORLD, "role": _GROUP, "control": _CONTROL, "startup": _STARTUP,
              "host": _HOST, "target mesh": target_group()}
    return {name: _backend_of(group).options._timeout.total_seconds() for name, group in groups.items()
            if group is not None}


def _backend_of(group: Any) -> Any:
    device = torch.device("cuda") if get_dist().backend == "nccl" and group not in (_CONTROL, _STARTUP, _HOST) \
        else torch.device("cpu")
    return group._get_backend(device)


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
    global _STATE, _GROUP, _TARGET_MESH, _CONTROL, _STARTUP, _HOST, _CLOCKS, _MESH_WAIT
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    _STATE = _GROUP = _TARGET_MESH = _CONTROL = _STARTUP = _HOST = None
    _CLOCKS, _MESH_WAIT = Clocks(), "collective"


def _active() -> bool:
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size(_GROUP) > 1


def _fail(op: str, exc: BaseException, wait: Wait = "collective") -> CollectiveError:
    d = get_dist()
    return CollectiveError(
        f"{op} failed on rank {d.rank}/{d.world_size} (its clock: {_CLOCKS.describe(wait)}): {exc}. "
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


def clock(wait: Wait) -> float:
    """Seconds a wait of kind ``wait`` may last in this job (:class:`Clocks`), for waits outside
    this module (a thread's join on a watched receive)."""
    return _CLOCKS.seconds(wait)


def describe_clock(wait: Wait) -> str:
    """E.g. "train.pause_timeout_s = 3600 s", for messages outside this module."""
    return _CLOCKS.describe(wait)


def startup_barrier(what: str) -> None:
    """Block until every rank of the job (both roles) has finished ``what`` (e.g. "loading the
    target and the data"), waiting up to the start-up clock instead of the collective one:
    host-side, on the gloo start-up group, so no device collective (DDP's first broadcast, a
    step's all-reduce) starts while a rank is still reading from shared storage. Raises
    :class:`StartupError` naming the ranks that did not arrive (on rank 0) or the barrier (on
    the others). No-op without a process group."""
    if _STARTUP is None:
        return
    _monitored_barrier(_STARTUP, f"start-up barrier after {what}", "startup")


def host_barrier(what: str, wait: Literal["startup", "pause"]) -> None:
    """Block until every rank of this rank's role has finished ``what``, host-side on the role's
    gloo group, up to the clock of ``wait``: for a wait that outlasts a step's collective --
    rank 0's checkpoint save or eval ("pause"), a rank loading its shard of a sharded target or
    receiving a HELLO ("startup"). On the device group NCCL's watchdog would fail it after the
    collective timeout; after this barrier the role's next device collective starts at once.
    Raises :class:`CollectiveError` (:class:`StartupError` for "startup") naming ``what``, the
    clock and, on rank 0, the ranks that did not arrive. No-op without a process group."""
    if not _active():
        return
    if _HOST is None:  # a group made outside init_distributed (a test harness's): its own timeout
        barrier()
        return
    _monitored_barrier(_HOST, what, wait)


def _monitored_barrier(group: Any, what: str, wait: Wait) -> None:
    begin = time.monotonic()
    try:
        # monitored: rank 0 collects every rank's arrival and names the missing ones
        tdist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=_CLOCKS.seconds(wait)),
                                wait_all_ranks=True)
    except RuntimeError as exc:
        error = StartupError if wait == "startup" else CollectiveError
        now = time.monotonic()
        waited, limit = now - begin, _CLOCKS.seconds(wait)
        # This rank may itself be the late one: at start-up the others have waited since the group
        # was made at the latest, and may have given up on it (their connection closes at once).
        late = wait == "startup" and now - _STARTUP_SINCE >= 0.9 * limit
        if waited < 0.9 * limit and not late:  # failed long before the timeout: a peer's connection closed
            raise error(
                f"{what}: rank {tdist.get_rank()} of {tdist.get_world_size()} lost a peer after {waited:.1f} s, "
                f"long before {_CLOCKS.knob(wait)}={limit:g} s ({exc}): a rank died"
                f"{' during start-up' if wait == 'startup' else ''}; its log has the first error") from exc
        raise error(
            f"{what}: rank {tdist.get_rank()} of {tdist.get_world_size()} waited {_CLOCKS.describe(wait)} and the "
            f"others did not all arrive ({exc}). A rank is slower than that (a slow shared filesystem: raise "
            f"{_CLOCKS.knob(wait)}) or died (check its log for the first error)") from exc


@contextlib.contextmanager
def collective_errors(op: str, target_group: bool = False):
    """Turn a torch.distributed failure inside the block (e.g. DDP's all-reduce in backward)
    into :class:`CollectiveError` naming ``op`` and its clock (``target_group``: collectives of
    the target group's mesh, a sharded target's forward). Other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as exc:
        # DDP's reducer re-raises gloo/NCCL failures as plain RuntimeError; recognise them by the
        # backend's wording so that real bugs (shape errors, OOM) are never relabelled.
        if not _active() or not (isinstance(exc, tdist.DistError) or _COMM_FAILURE.search(str(exc))):
            raise
        raise _fail(op, exc, _MESH_WAIT if target_group else "collective") from exc


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
        raise _fail("all_reduce(max) over the target group", exc, _MESH_WAIT) from exc
    return tensor


def target_group_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` of the target group's first rank, on every rank of the group (in place)."""
    group = target_group()
    if group is None:
        return tensor
    try:
        tdist.broadcast(tensor, group=group, group_src=0)
    except RuntimeError as exc:
        raise _fail("broadcast over the target group", exc, _MESH_WAIT) from exc
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
    memory on gloo with the start-up clock: small start-up data (a checkpoint part's size and
    skeleton; bytes of real size go through ``host_broadcast_bytes``, pickling copies them).
    Host sync. Identity without a process group; on a group made outside init_distributed (a
    test harness's), ``broadcast_object``."""
    if not _active():
        return obj
    box = [obj]
    try:
        tdist.broadcast_object_list(box, group=_HOST if _HOST is not None else _GROUP, group_src=0)
    except RuntimeError as exc:
        raise _fail("host_broadcast_object", exc, "startup") from exc
    return box[0]


# One message of a streamed host broadcast: no gloo message of GBs (or over 4 GB), and nothing
# of the data's size is copied on the way.
HOST_CHUNK_BYTES = 64 * 2**20


def host_broadcast_bytes(data: bytearray | None, size: int) -> bytearray:
    """Rank 0's ``data`` (``size`` bytes; None on the other ranks, who know ``size``) on every rank
    of the role, streamed through host memory on gloo with the start-up clock in messages of at
    most ``HOST_CHUNK_BYTES``, each received straight into its place in the returned buffer: a
    rank holds the data once, plus nothing of its size (the resume's replicated checkpoint parts,
    GBs at real sizes). Host sync. ``data`` itself without a process group."""
    if not _active():
        return data
    buffer = data if get_rank() == 0 else bytearray(size)
    if len(buffer) != size:
        raise ValueError(f"host_broadcast_bytes: rank 0 has {len(buffer)} bytes, the others expect {size}")
    group = _HOST if _HOST is not None else _GROUP
    try:
        for offset in range(0, size, HOST_CHUNK_BYTES):
            chunk = torch.frombuffer(buffer, dtype=torch.uint8, count=min(HOST_CHUNK_BYTES, size - offset),
                                     offset=offset)  # a view: gloo reads or writes the buffer in place
            tdist.broadcast(chunk, group=group, group_src=0)
    except RuntimeError as exc:
        raise _fail("host_broadcast_bytes", exc, "startup") from exc
    return buffer


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
    """A pending ``isend`` / ``irecv`` and the clock of what it waits for (``wait``, a
    :class:`Clocks` kind). ``done()`` polls; ``wait()`` blocks until it completed, at most its
    clock, and turns a failure (a dead peer closes the connection: noticed at once on gloo) into
    :class:`CollectiveError` naming the clock."""

    def __init__(self, work: Any, op: str, wait: Wait):
        self._work, self.op, self.clock = work, op, wait
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._work.is_completed()

    def wait(self) -> None:
        """Idempotent (a second wait on a gloo receive would wait for another message). On gloo
        the clock is this wait's own (told no timeout, gloo would take the group's, and a wait that
        expires closes every connection of the group). A receive on the "watch" clock is waited on
        by a watcher thread (``feed.flow.Watcher``) while its owner polls: gloo reports a
        point-to-point op's completion only to a wait (``done()`` stays False until then)."""
        if self._finished:
            return
        try:
            self._work.wait(datetime.timedelta(seconds=_CLOCKS.seconds(self.clock)))
        except RuntimeError as exc:
            raise _fail(self.op, exc, self.clock) from exc
        self._finished = True


def control_group() -> Any:
    """The gloo group carrying the feature links' control messages (disaggregated placement);
    None otherwise."""
    return _CONTROL


def isend(tensor: torch.Tensor, dst: int) -> Transfer:
    """Start sending ``tensor`` to GLOBAL rank ``dst`` on the data channel (the device group);
    keep it unchanged until ``wait()``. Messages between two ranks arrive in the order they were
    sent. Only ever from the sending side of a one-way flow: under NCCL a pair's ops run in
    posting order on one stream, so an op against the flow would stall the flow (module doc).
    Its clock is the link's: a send completes when the receiver takes it, after its step and
    whatever pause (a checkpoint save, an eval) it is in."""
    return _p2p(tdist.isend, tensor, dst, None, f"send to rank {dst}", "link")


def irecv(tensor: torch.Tensor, src: int) -> Transfer:
    """Start receiving into ``tensor`` (its shape and dtype must match the sender's) from
    GLOBAL rank ``src`` on the data channel (the device group): the receiving side of a
    one-way flow only (see ``isend``). Its clock is the collective one: the sender posts each
    step's tensors as soon as it has them."""
    return _p2p(tdist.irecv, tensor, src, None, f"receive from rank {src}", "collective")


def control_isend(tensor: torch.Tensor, dst: int) -> Transfer:
    """Start sending the host tensor ``tensor`` to GLOBAL rank ``dst`` on the control channel
    (gloo: its receives, however long-lived, never hold back the data channel). The link's clock,
    as ``isend``."""
    return _p2p(tdist.isend, _host(tensor), dst, _control(), f"control send to rank {dst}", "link")


def control_irecv(tensor: torch.Tensor, src: int, wait: Literal["collective", "startup", "watch"] = "collective"
                  ) -> Transfer:
    """Start receiving into the host tensor ``tensor`` from GLOBAL rank ``src`` on the control
    channel, waited for up to the clock ``wait`` names: "collective" for a step's message,
    "startup" for a message sent once the peer has started (a HELLO), "watch" for one that may
    come at any time of the run (a drafter rank's DONE / STOP / ABORT)."""
    return _p2p(tdist.irecv, _host(tensor), src, _control(), f"control receive from rank {src}", wait)


def _p2p(op, tensor: torch.Tensor, peer: int, group: Any, what: str, wait: Wait) -> Transfer:
    try:
        return Transfer(op(tensor, peer, group=group), what, wait)
    except RuntimeError as exc:
        raise _fail(what, exc, wait) from exc


def _control() -> Any:
    if _CONTROL is None:
        raise RuntimeError("no control channel: it exists in a disaggregated job only (init_distributed with "
                           "num_target_ranks > 0)")
    return _CONTROL


def _host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ValueError(f"the control channel (gloo) carries host tensors; got one on {tensor.device}")
    return tensor
