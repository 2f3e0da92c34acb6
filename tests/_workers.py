"""Worker processes for the multi-process tests: ``python _workers.py SCENARIO ARGS...``.

Launched by tests/conftest.py with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). Each scenario prints one ``RESULT <json>`` line for the test.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

from flashdraft import distributed as D


def result(obj) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def collectives_then_peer_hangs(timeout_s: str) -> None:
    """Every helper on 2 gloo ranks, then rank 1 hangs and rank 0's barrier must time out."""
    d = D.init_distributed("cpu", timeout_s=float(timeout_s))
    out: dict = {"rank": d.rank, "world_size": d.world_size, "backend": d.backend, "is_main": d.is_main,
                 "device": str(d.device)}
    x = torch.tensor([float(d.rank + 1), 10.0 * (d.rank + 1)])
    out["mean"] = D.all_reduce(x.clone(), "mean").tolist()
    out["sum"] = D.all_reduce(x.clone(), "sum").tolist()
    out["max"] = D.all_reduce(x.clone(), "max").tolist()
    out["bcast"] = D.broadcast_object({"from": d.rank, "big": 2**70} if d.rank == 0 else None)
    out["bcast"]["big"] = str(out["bcast"]["big"])
    out["all_gather"] = D.all_gather_object(d.rank * 3)
    out["gather"] = D.gather_object(f"r{d.rank}")
    D.barrier()
    if d.rank == 1:
        result(out)
        time.sleep(120)  # hung rank: the test kills it
        return
    t0 = time.monotonic()
    try:
        D.barrier()
        out["error"] = None
    except D.CollectiveError as exc:
        out["error"] = str(exc)
    out["waited_s"] = time.monotonic() - t0
    result(out)
    os._exit(0)  # do not wait for the hung peer in process-group teardown


def peer_exits(timeout_s: str) -> None:
    """Rank 1 dies without a word; rank 0's next collective must fail, not hang."""
    d = D.init_distributed("cpu", timeout_s=float(timeout_s))
    D.barrier()
    if d.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        D.all_reduce(torch.ones(4), "sum")
        err = None
    except D.CollectiveError as exc:
        err = str(exc)
    result({"error": err, "waited_s": time.monotonic() - t0})
    os._exit(0)


def group_clocks(target_ranks: str, tensor_parallel: str) -> None:
    """Start a job with clocks collective 5 s, start-up 60 s, pause 30 s (``target_ranks`` > 0:
    disaggregated) and report each of this rank's process groups' timeouts, and its role."""
    d = D.init_distributed("cpu", timeout_s=5, num_target_ranks=int(target_ranks),
                           tensor_parallel=int(tensor_parallel), startup_timeout_s=60, pause_timeout_s=30)
    result({"role": d.role, "timeouts": D.group_timeouts()})
    D.teardown()


def gloo_on_two_hosts(case: str, interface: str) -> None:
    """Rank 1 poses as a second host (its hostname, an RFC 6761 name that never resolves) of a
    job launched one process per node (LOCAL_WORLD_SIZE=1); every rank reports the error its
    start-up raised. ``case`` "loopback": rank 1's hostname resolves to nothing, so its gloo
    address falls back to 127.0.0.1. "unreachable": both bind gloo to ``interface``
    (GLOO_SOCKET_IFNAME) and rank 1's port refuses connections, as a firewall that resets them
    would (its probe socket never listens)."""
    import socket

    rank = int(os.environ["RANK"])
    if case == "unreachable":
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    if rank == 1:
        socket.gethostname = lambda: "flashdraft-test-node1.invalid"
        if case == "unreachable":
            socket.socket.listen = lambda self, *args: None
    try:
        D.init_distributed("cpu", timeout_s=30)
        err = None
    except D.StartupError as exc:
        err = f"{type(exc).__name__}: {exc}"
    result({"rank": rank, "error": err})
    os._exit(0)


def checkpoint_per_rank_rng(root: str) -> None:
    """Each rank saves its own RNG state; after scrambling, load_latest gives each its own back."""
    import numpy as np

    from flashdraft.checkpoint import CheckpointManager

    d = D.init_distributed("cpu", timeout_s=60)
    torch.manual_seed(1000 + d.rank)
    random.seed(2000 + d.rank)
    rng_np = np.random.default_rng(3000 + d.rank)

    def rng_state():
        return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": rng_np.bit_generator.state}

    model = {"w": torch.arange(6.0).reshape(2, 3)}  # replicated: identical on every rank
    mgr = CheckpointManager(root, keep_last=2)
    path = mgr.save(7, {"model": model}, per_rank_parts={"rng": rng_state()}, config={"seed": 0})
    # Right after save returns, rank 0 has finished: the checkpoint must be complete here.
    visible = (path / "manifest.json").is_file()
    expected = (torch.rand(5).tolist(), random.random(), rng_np.random())
    torch.manual_seed(0)
    random.seed(0)
    rng_np = np.random.default_rng(0)
    step, parts, config = mgr.load_latest()
    torch.set_rng_state(parts["rng"]["torch"])
    random.setstate(parts["rng"]["python"])
    rng_np.bit_generator.state = parts["rng"]["numpy"]
    got = (torch.rand(5).tolist(), random.random(), rng_np.random())
    files = sorted(p.name for p in path.iterdir())
    result({"rank": d.rank, "visible": visible, "step": step, "config": config, "same": got == expected,
            "w": parts["model"]["w"].tolist(), "files": files})
    D.teardown()


def checkpoint_save_fails_everywhere(root: str) -> None:
    """Rank 0 cannot write (``root`` lies under a regular file): every rank must raise, none hang."""
    from flashdraft.checkpoint import CheckpointError, CheckpointManager

    d = D.init_distributed("cpu", timeout_s=30)
    t0 = time.monotonic()
    try:
        CheckpointManager(root).save(1, {"m": {"w": torch.ones(2)}}, per_rank_parts={"rng": torch.get_rng_state()})
        err = None
    except CheckpointError as exc:
        err = str(exc)
    result({"rank": d.rank, "error": err, "waited_s": time.monotonic() - t0})
    D.teardown()


def checkpoint_writer(root: str) -> None:
    """Save checkpoints 1, 2, 3, ... under ``root`` until killed; print each completed step."""
    from flashdraft.checkpoint import CheckpointManager

    gen = torch.Generator().manual_seed(0)
    big = torch.randn(6 * 1024 * 1024, generator=gen)  # 24 MB: saves take long enough to be interrupted
    mgr = CheckpointManager(root, keep_last=2)
    print("writing", flush=True)
    step = 1
    while True:
        t0 = time.monotonic()
        mgr.save(step, {"model": {"w": big, "marker": torch.full((4,), step)}, "meta": {"step": step}})
        print(f"saved {step} {time.monotonic() - t0:.3f}", flush=True)
        step += 1


def census(*classes) -> dict[str, list]:
    """Every instance of ``classes`` constructed from now on in this process, by class name: each
    ``__init__`` is wrapped (the real one runs) to record its instance (a subclass's instance
    counts once, under the base it reaches)."""
    built: dict[str, list] = {cls.__name__: [] for cls in classes}

    def recording(cls):
        real = cls.__init__

        def init(self, *args, **kwargs):
            real(self, *args, **kwargs)
            built[cls.__name__].append(self)

        return init

    for cls in classes:
        cls.__init__ = recording(cls)
    return built


def _trainer_parts(built: dict[str, list]) -> dict[str, int]:
    """How many of each part only training needs were built (census): target models excluded."""
    return {name: len(found) for name, found in built.items() if name != "TargetModel"}


def train_ranks(overrides_json: str, stop_at: str = "0") -> None:
    """flashdraft training on every rank; reports per-step losses, whether the drafter's
    parameters were bit-identical across ranks after every optimizer step, the valid anchored
    blocks this rank trained on per step, and each optimizer step's [step, learning rate, this
    rank's sample ids]. SIGTERM to itself during step ``stop_at`` (before the step's vote, so the
    run stops after that step with a checkpoint; 0: run to the end). A disaggregated target rank
    runs the entry point, ``train``, which serves features; every rank reports what it built
    (``built``: drafters, optimizers, checkpoint managers, validators)."""
    import signal

    from flashdraft.config import load_config
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.signals import Stopped
    from flashdraft.target import TargetModel
    from flashdraft.train.state import RunCheckpoints
    from flashdraft.train.trainer import Trainer, train
    from flashdraft.train.validation import Validator

    built = census(TargetModel, DFlashDrafter, torch.optim.Optimizer, RunCheckpoints, Validator)
    config = load_config(overrides=json.loads(overrides_json))
    if config.pipeline.placement == "disaggregated" and \
            int(os.environ["RANK"]) in D.role_layout(int(os.environ["WORLD_SIZE"]), config.pipeline.target_ranks,
                                                     config.target.tensor_parallel)[1]:
        stopped = False
        try:
            train(config)  # a target rank: serves features, then leaves the process group
        except Stopped:  # its drafter ranks stopped early: so does it
            stopped = True
        (target,) = built["TargetModel"]
        result({"losses": [], "identical": [], "cache": {}, "blocks": [], "target_sharded": target.sharded,
                "stopped": stopped,
                "target_layers_loaded": not any(p.is_meta for p in target.layers.parameters()),
                "built": _trainer_parts(built)})
        return
    identical: list[bool] = []

    def check(trainer) -> None:  # after every optimizer step
        flat = torch.cat([p.detach().flatten() for p in trainer.drafter.parameters()])
        digests = D.all_gather_object(flat.numpy().tobytes())
        identical.append(all(d == digests[0] for d in digests))

    trainer = Trainer(config)
    target_in_ddp = any(p is q for p in trainer.model.parameters() for q in trainer.target.parameters())
    layers_loaded = not any(p.is_meta for p in trainer.target.layers.parameters())
    blocks, steps, make_blocks = [], [], trainer.strategy.blocks

    def counted(micro, step, position):  # made once per optimizer step, before the step's vote
        ids = sorted(int(i) for m in micro for i in m.sample_ids)
        steps.append([step + 1, trainer.scheduler.get_last_lr()[0], ids])  # the lr this step trains with
        if step + 1 == int(stop_at):
            os.kill(os.getpid(), signal.SIGTERM)
        made = make_blocks(micro, step, position)
        blocks.append(int(sum(int(b.valid.sum()) for b in made)))  # the valid anchored blocks this rank trains on
        return made

    trainer.strategy.blocks = counted
    stopped = False
    try:
        trainer.fit(on_step=check)
    except Stopped:
        stopped = True
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    last = trainer.history[-1] if trainer.history else {}
    cache = {k: v for k, v in last.items() if k.startswith("cache/")}
    result({"losses": losses, "identical": identical, "target_in_ddp": target_in_ddp,
            "ddp": type(trainer.model).__name__, "cache": cache, "target_layers_loaded": layers_loaded,
            "blocks": blocks, "target_sharded": trainer.target.sharded, "steps": steps,
            "total_steps": trainer.total_steps, "stopped": stopped, "final_step": trainer.step,
            "built": _trainer_parts(built)})
    trainer.close()
    D.teardown()


def train_collectives(overrides_json: str) -> None:
    """flashdraft training on every rank, recording the collectives torch.distributed is asked
    for between one optimizer step's hook and the next (name and element count; DDP's bucketed
    gradient all-reduce runs in C++ and is not seen here)."""
    import torch.distributed as tdist

    from flashdraft.config import load_config
    from flashdraft.train.trainer import Trainer

    seen: list = []
    names = ("all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather", "all_gather_object",
             "broadcast_object_list", "gather_object")

    def counted(name, real):
        def call(*args, **kwargs):
            seen.append([name, int(args[0].numel()) if args and isinstance(args[0], torch.Tensor) else 0])
            return real(*args, **kwargs)
        return call

    for name in names:
        setattr(tdist, name, counted(name, getattr(tdist, name)))
    per_step: list = []

    def hook(trainer) -> None:
        per_step.append(list(seen))
        seen.clear()

    trainer = Trainer(load_config(overrides=json.loads(overrides_json)))
    trainer.fit(on_step=hook)
    result({"per_step": per_step})
    trainer.close()
    D.teardown()


def train_slow_loader(overrides_json: str, sleep_s: str, what: str = "target") -> None:
    """flashdraft training on every rank, with a slow shared filesystem: ``what`` = "target":
    rank 1 loads its target ``sleep_s`` seconds late ("die": then exits, killed mid start-up,
    before the start-up barrier); "verify": rank 0's verification of each
    checkpoint (hashing every file) takes ``sleep_s`` longer. Each rank reports its error
    (None: trained) and its step count."""
    import flashdraft.checkpoint as checkpoint_mod
    import flashdraft.target as target_mod
    from flashdraft.config import load_config
    from flashdraft.train.trainer import Trainer

    rank = int(os.environ["RANK"])
    if what in ("target", "die"):
        real = target_mod.TargetModel.from_pretrained.__func__

        def slow(cls, *args, **kwargs):
            if rank == 1:
                time.sleep(float(sleep_s))
                if what == "die":
                    os._exit(9)
            return real(cls, *args, **kwargs)

        target_mod.TargetModel.from_pretrained = classmethod(slow)
    else:
        verify = checkpoint_mod.verify_checkpoint

        def slow_verify(path):
            if rank == 0:
                time.sleep(float(sleep_s))
            return verify(path)

        checkpoint_mod.verify_checkpoint = slow_verify
    err, steps, trainer = None, 0, None
    try:
        trainer = Trainer(load_config(overrides=json.loads(overrides_json)))
        trainer.fit()
        steps = trainer.step
    except BaseException as exc:  # reported to the test
        err = f"{type(exc).__name__}: {exc}"
    result({"rank": int(os.environ["RANK"]), "error": err, "steps": steps})
    if err is None:
        trainer.close()
        D.teardown()
    os._exit(0 if err is None else 1)  # a failed rank skips the teardown (its peer may be gone)


def convert_once(source: str, marks: str, flock: str) -> None:
    """Every rank opens the parquet ``source`` (converted into a token shard on first use) on a
    filesystem whose flock is ``flock``: "enosys" (Lustre mounted without flock) or "per_node"
    (NFS without a lock manager across nodes: every caller gets the lock). The conversion leaves
    ``marks/rank<R>`` and takes 3 s, longer than the collective timeout."""
    import errno
    import fcntl

    from flashdraft.data import convert
    from flashdraft.data.dataset import open_dataset

    d = D.init_distributed("cpu", timeout_s=2, startup_timeout_s=60)

    def no_flock(fd, op):
        if flock == "enosys":
            raise OSError(errno.ENOSYS, "Function not implemented")

    fcntl.flock = no_flock
    real = convert.convert_to_shard

    def marked(path, out, **kwargs):
        open(os.path.join(marks, f"rank{d.rank}"), "w").close()
        time.sleep(3)
        return real(path, out, **kwargs)

    convert.convert_to_shard = marked
    try:
        found = {"samples": len(open_dataset(source, progress=False)), "error": None}
    except Exception as exc:  # reported to the test
        found = {"samples": 0, "error": f"{type(exc).__name__}: {exc}"}
    result({"rank": d.rank, **found})
    D.teardown()


def resume_reads(root: str) -> None:
    """Save a checkpoint with two replicated parts and a per-rank one, then load it on every
    rank (load_latest, as a resume does); report which part files this rank read while
    loading (the verification's hashing excluded: it is done first) and whether every part
    came back equal."""
    import safetensors.torch

    from flashdraft.checkpoint import CheckpointManager

    d = D.init_distributed("cpu", timeout_s=60)
    gen = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(64, 32, generator=gen), "b": torch.arange(5)}
    optim = {"state": {"0": {"exp_avg": torch.randn(64, 32, generator=gen), "step": torch.tensor(3.0)}}, "lr": 0.1}
    rng = {"seed": torch.full((3,), d.rank)}
    mgr = CheckpointManager(root)
    path = mgr.save(5, {"model": model, "optimizer": optim}, per_rank_parts={"rng": rng})
    verified = mgr.latest_complete() if d.rank == 0 else None
    read: list[str] = []
    reading = [True]

    def audit(event, args):
        if reading[0] and event == "open" and isinstance(args[0], str) and args[0].endswith(".safetensors"):
            read.append(os.path.basename(args[0]))

    sys.addaudithook(audit)
    real = safetensors.torch.load_file

    def load_file(filename, *args, **kwargs):  # opened by Rust: no audit event
        read.append(os.path.basename(str(filename)))
        return real(filename, *args, **kwargs)

    safetensors.torch.load_file = load_file
    loaded = mgr.load_latest(verified=verified)  # verified first: hashing is not part of this count
    reading[0] = False
    same = (all(torch.equal(loaded.parts["model"][k], v) for k, v in model.items())
            and torch.equal(loaded.parts["optimizer"]["state"]["0"]["exp_avg"], optim["state"]["0"]["exp_avg"])
            and loaded.parts["optimizer"]["lr"] == 0.1 and torch.equal(loaded.parts["rng"]["seed"], rng["seed"]))
    result({"rank": d.rank, "read": sorted(read), "same": same, "step": loaded.step, "path": str(path)})
    D.teardown()


def _memory_kib() -> dict[str, int]:
    """This process's resident set now and its peak since the last reset (Linux /proc), KiB."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                found[line.split(":")[0]] = int(line.split()[1])
    return found


def resume_peak_rss(root: str) -> None:
    """Every rank loads the newest checkpoint under ``root`` as a resume does (load_latest: rank 0
    reads the replicated parts once and broadcasts them; its verification is taken as done), and
    reports the peak of its resident set over the load above the resident set before it, and a
    CRC-32 of every tensor's bytes it got, per part (position-sensitive: a misplaced chunk shows)."""
    import zlib

    from flashdraft.checkpoint import CheckpointManager

    D.init_distributed("cpu", timeout_s=120)
    manager = CheckpointManager(root)
    verified = manager.checkpoints()[0] if D.get_rank() == 0 else None
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the resident set now
        f.write("5")
    before = _memory_kib()["VmRSS"]
    loaded = manager.load_latest(verified=verified)
    peak = _memory_kib()["VmHWM"]
    digests = {name: {k: zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                      for k, t in part.items()} for name, part in loaded.parts.items()}
    result({"rank": D.get_rank(), "peak_above_mib": (peak - before) / 1024, "digests": digests,
            "step": loaded.step})
    D.teardown()


def pace_steps(seconds: float) -> None:
    """Make every optimizer step of this process last ``seconds`` longer, so that a test's kill
    lands at a chosen moment of a run (the trainer itself has no test hook)."""
    if seconds <= 0:
        return
    from flashdraft.train.step import DrafterStep

    step = DrafterStep.__call__

    def paced(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        print("[paced] optimizer step done", file=sys.stderr, flush=True)  # tests wait for this line
        time.sleep(seconds)
        return out

    DrafterStep.__call__ = paced


def pace_checkpoint_writes(seconds: float) -> None:
    """Make every checkpoint part's write of this process last ``seconds`` longer (its temp dir
    exists meanwhile), so that a test's kill lands inside a write however busy the machine is."""
    if seconds <= 0:
        return
    from flashdraft import checkpoint

    write = checkpoint._write_part

    def paced(tmp, name, state):
        time.sleep(seconds)
        return write(tmp, name, state)

    checkpoint._write_part = paced


def pace_evals(seconds: float) -> None:
    """Make every eval of this process last ``seconds`` longer on the ranks that compute it (the
    others wait for it at the eval's barrier)."""
    if seconds <= 0:
        return
    from flashdraft.train.validation import Validator

    run = Validator.run

    def paced(self):
        if self.runs_eval:
            time.sleep(seconds)
        return run(self)

    Validator.run = paced


def pace_hello(seconds: float) -> None:
    """Make a disaggregated drafter rank of this process send its HELLO ``seconds`` late (a slow
    resume: its target rank, and the rest of its target group, wait for it)."""
    if seconds <= 0:
        return
    from flashdraft.feed import disaggregated

    hello = disaggregated._DrafterLink.hello

    def paced(self, *args, **kwargs):
        time.sleep(seconds)
        return hello(self, *args, **kwargs)

    disaggregated._DrafterLink.hello = paced


def cli(*argv: str) -> None:
    """``flashdraft ARGV...`` exactly as the console script runs it; exits with its status."""
    import signal

    from flashdraft.cli import main, stopped
    from flashdraft.signals import Stopped

    if os.environ.get("FLASHDRAFT_TEST_IGNORE_SIGXFSZ"):  # a file-size limit then fails writes (EFBIG), like ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    pace_steps(float(os.environ.get("FLASHDRAFT_TEST_STEP_SLEEP", "0")))
    pace_checkpoint_writes(float(os.environ.get("FLASHDRAFT_TEST_WRITE_SLEEP", "0")))
    pace_evals(float(os.environ.get("FLASHDRAFT_TEST_EVAL_SLEEP", "0")))
    pace_hello(float(os.environ.get("FLASHDRAFT_TEST_HELLO_SLEEP", "0")))
    try:
        code = main(list(argv))
    except Stopped as exc:  # as the console script reports it (flashdraft.cli.entry)
        code = stopped(argv[0], exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def train_rank_fails(overrides_json: str, how: str, at_step: str, mark: str) -> None:
    """A 2-rank Trainer job in which rank 1 dies (``how=die``: os._exit) or hangs (``how=hang``)
    inside optimizer step ``at_step``, after the step's first collective and before DDP's
    gradient all-reduce. Rank 0 must fail with a clear error within train.collective_timeout_s
    and its process must exit; it reports the error and the time it exits (teardown included);
    rank 1 writes the time of its fault to ``mark``."""
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    rank, at = int(os.environ["RANK"]), int(at_step)
    import flashdraft.target as target_mod

    real_features = target_mod.TargetModel.features
    calls = {"n": 0}

    def features(self, *args, **kwargs):  # rank 1's target stage of step ``at`` is the fault
        calls["n"] += 1
        if rank == 1 and calls["n"] == at:
            with open(mark, "w") as f:  # when the fault happened, for rank 0's deadline
                f.write(repr(time.time()))
            if how == "die":
                os._exit(3)
            time.sleep(600)
        return real_features(self, *args, **kwargs)

    target_mod.TargetModel.features = features
    err = None
    try:
        train(load_config(overrides=json.loads(overrides_json)))
    except BaseException as exc:  # reported to the test
        import traceback

        traceback.print_exc()
        err = f"{type(exc).__name__}: {exc}"
    result({"rank": rank, "error": err, "exit_time": time.time()})
    os._exit(0 if err is None else 1)


def train_target_raises(overrides_json: str, at_call: str) -> None:
    """A disaggregated job whose target rank raises inside its ``at_call``-th target forward.
    Every rank must end with an error (none may hang); each reports it."""
    import flashdraft.target as target_mod
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    real_features = target_mod.TargetModel.features
    calls = {"n": 0}
    world, targets = int(os.environ["WORLD_SIZE"]), json.loads(overrides_json)
    num_targets = int(next(o for o in targets if o.startswith("pipeline.target_ranks=")).split("=")[1])
    is_target = int(os.environ["RANK"]) >= world - num_targets

    def features(self, *args, **kwargs):
        calls["n"] += 1
        if is_target and calls["n"] == int(at_call):
            raise RuntimeError("injected target failure")
        return real_features(self, *args, **kwargs)

    target_mod.TargetModel.features = features
    err = None
    try:
        train(load_config(overrides=targets))
    except BaseException as exc:  # reported to the test
        err = f"{type(exc).__name__}: {exc}"
    result({"rank": int(os.environ["RANK"]), "error": err})
    os._exit(0 if err is None else 1)


def sharded_features(cases_json: str, tensor_parallel: str) -> None:
    """Each case ``[model_dir, expert_parallel]``: the target sharded over target groups of
    ``tensor_parallel`` ranks -- its taps, its cached decoding forward (logits and taps: two
    steps through a cache, then a verification whose rejected tokens are rewound, rewind_cache,
    and one more step) against the same target loaded whole in this process, and the weights
    each rank holds. One result per case."""
    from flashdraft.target import TargetModel, mark_cache, rewind_cache

    tp = int(tensor_parallel)
    d = D.init_distributed("cpu", timeout_s=60, tensor_parallel=tp)
    found = []
    for model_dir, expert_parallel in json.loads(cases_json):
        whole = TargetModel.from_pretrained(model_dir, target_layer_ids=[0, 2, 3])
        sharded = TargetModel.from_pretrained(model_dir, target_layer_ids=[0, 2, 3], tensor_parallel=tp,
                                              expert_parallel=expert_parallel)
        g = torch.Generator().manual_seed(d.data_rank)  # each target group its own batch, as in training
        ids = torch.randint(0, 290, (2, 19), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 15:] = 0
        out: dict = {"model": model_dir, "expert_parallel": expert_parallel, "rank": d.rank,
                     "tensor_rank": d.tensor_rank, "data_rank": d.data_rank}
        with torch.no_grad():
            out["features_err"] = (sharded.features(ids, mask) - whole.features(ids, mask)).abs().max().item()
            errs = []
            caches = (whole.new_cache(), sharded.new_cache())
            for start, stop, keep in ((0, 11, None), (11, 15, None), (15, 19, 1), (16, 19, None)):
                marks = [mark_cache(c) for c in caches]
                (lw, tw), (ls, ts) = (m.forward_with_cache(ids[:1, start:stop], c, start)
                                      for m, c in zip((whole, sharded), caches))
                errs += [(ls - lw).abs().max().item(), (ts - tw).abs().max().item()]
                if keep is not None:  # a verification that kept 1 of its 4 tokens
                    for m, c, mark in zip((whole, sharded), caches, marks):
                        rewind_cache(m, c, mark, ids[0, start:start + keep].tolist())
            out["decode_err"] = max(errs)
            out["head_err"] = (sharded.lm_head.weight - whole.lm_head.weight).abs().max().item()
        out["local_params"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                  for p in sharded.model.parameters())
        out["whole_params"] = sum(p.numel() for p in whole.model.parameters())
        out["sharded"] = sharded.sharded
        found.append(out)
    result(found)
    D.teardown()


def backend_ranks() -> None:
    """The Backend on every gloo rank: a DDP-wrapped drafter (the same init everywhere), its own
    data per rank, plain SGD. Reports the global normaliser; digests of the gradients after a
    backward under accumulating(sync=False) and after the synced one, and whether the latter are
    the mean over ranks of each rank's two micro-batches (a bare replica's); then a step in which
    rank 1's loss is non-finite and rank 0 asks to stop, and a normal step."""
    import copy
    import hashlib

    from flashdraft.config import ObjectiveConfig
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.objective import make_blocks
    from flashdraft.target import TargetModel
    from flashdraft.toy import tiny_causal_lm
    from flashdraft.train.backend import Backend
    from flashdraft.train.step import forward_backward
    from flashdraft.train.strategy import strategy_for

    d = D.init_distributed("cpu", timeout_s=60)
    target = TargetModel(tiny_causal_lm(300, num_layers=2, hidden=32, seed=0), [0, 1])
    drafter = DFlashDrafter.for_target(target, num_layers=1, block_size=4, mask_token_id=299)
    drafter.reset_parameters(0.02, torch.Generator().manual_seed(0))
    bare = copy.deepcopy(drafter)
    g = torch.Generator().manual_seed(100 + d.rank)
    inputs = []
    for k in range(3):
        ids = torch.randint(0, 299, (2, 24), generator=g)
        with torch.no_grad():
            features = target.features(ids, torch.ones_like(ids))
        inputs.append((features, make_blocks(ids, torch.ones_like(ids), torch.full((2,), 24), block_size=4,
                                             mask_token_id=299, num_anchors=4, gamma=None, seed=k)))

    def grads(model):
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def digest(tensor):
        return hashlib.sha256(tensor.detach().numpy().tobytes()).hexdigest()

    objective = ObjectiveConfig(num_anchors=4)
    optimizer = torch.optim.SGD(drafter.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    backend = Backend(drafter, optimizer, scheduler, grad_clip=1.0, world_size=d.world_size)
    strategy = strategy_for(drafter, target, objective)
    out = {"ddp": backend.model is not drafter,
           "normalizer": float(backend.normalizer([torch.tensor(float(d.rank + 1)), torch.tensor(10.0)]))}
    forward_backward(strategy, backend, *inputs[0], sync=False)
    out["local"] = digest(grads(drafter))
    forward_backward(strategy, backend, *inputs[1], sync=True)
    out["synced"] = digest(grads(drafter))
    alone = Backend(bare)
    for features, blocks in inputs[:2]:
        forward_backward(strategy_for(bare, target, objective), alone, features, blocks)
    mean = torch.stack(D.all_gather_object(grads(bare))).mean(0)
    out["synced_is_the_ranks_mean"] = bool(torch.allclose(grads(drafter), mean, rtol=1e-5, atol=1e-8))
    def weights():
        return torch.cat([p.detach().flatten() for p in drafter.parameters()]).clone()

    def outcome(update, before):
        unchanged = bool(torch.equal(weights(), before))
        return {"applied": update.applied, "stop": update.stop, "unchanged": unchanged}

    before = weights()
    out["skipped"] = outcome(backend.step(torch.tensor(d.rank != 1), stop=15 if d.rank == 0 else 0), before)
    forward_backward(strategy, backend, *inputs[2])
    out["applied"] = outcome(backend.step(torch.tensor(True)), before)
    out["weights"] = digest(weights())
    result(out)
    backend.release()
    D.teardown()


SCENARIOS = {f.__name__: f for f in (collectives_then_peer_hangs, peer_exits, gloo_on_two_hosts, group_clocks,
                                     checkpoint_per_rank_rng, train_ranks,
                                     checkpoint_save_fails_everywhere, checkpoint_writer, cli, train_rank_fails,
                                     train_target_raises, sharded_features,
                                     train_collectives, train_slow_loader, convert_once,
                                     resume_reads, resume_peak_rss, backend_ranks)}


def serve(*preload: str) -> None:
    """Fork server: torch is imported once here and every worker is forked from this process,
    so a multi-process test costs milliseconds to launch instead of an interpreter start each
    (seconds on 2 cores). Nothing here starts threads or runs torch compute before forking.

    stdin, one JSON per line: {"scenario", "args", "env", "out"} -> stdout "started <pid>".
    Exits of children are reported as "exited <pid> <status>" (negative: killed by signal).
    """
    import importlib
    import select
    import traceback

    import flashdraft.checkpoint  # noqa: F401  (warm the import for the children)

    for module in preload:  # e.g. flashdraft.train.trainer: transformers costs seconds per import on 2 cores
        importlib.import_module(module)

    torch.set_num_threads(1)
    print("ready", flush=True)
    children: set[int] = set()
    stdin_open, pending = True, b""
    while stdin_open or children:
        if stdin_open and select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            pending += chunk
            if not chunk:  # the test session ended: take the children down with us
                stdin_open = False
                for pid in children:
                    os.kill(pid, 9)
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                cmd = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        os.environ.update(cmd["env"])
                        fd = os.open(cmd["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                        os.dup2(fd, 1)
                        os.dup2(fd, 2)
                        if os.environ.get("FLASHDRAFT_TEST_P2P_LOG"):  # tests/p2p_model.py
                            import p2p_model

                            p2p_model.install_recorder(os.environ["FLASHDRAFT_TEST_P2P_LOG"])
                        SCENARIOS[cmd["scenario"]](*cmd["args"])
                    except BaseException:
                        traceback.print_exc()
                        code = 1
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                children.add(pid)
                print(f"started {pid}", flush=True)
        elif not stdin_open:
            time.sleep(0.02)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                print(f"exited {pid} {code}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(*sys.argv[2:])
    else:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
