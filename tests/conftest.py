"""Shared fixtures: tiny real Hugging Face targets, built in well under a second."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flashdraft.checkpoint import CheckpointManager
from flashdraft.data.shards import write_token_shard
from flashdraft.drafter import DFlashDrafter
from flashdraft.evaluate import write_prompts
from flashdraft.target import TargetModel
from flashdraft.toy import tiny_causal_lm

VOCAB = 300
MASK_ID = VOCAB - 1


def tiny_qwen3(num_layers: int = 6, hidden: int = 64, seed: int = 0, **kw) -> torch.nn.Module:
    """A tiny Qwen3 target; ``kw`` are further config fields (e.g. ``tie_word_embeddings``)."""
    return tiny_causal_lm(VOCAB, arch="qwen3", num_layers=num_layers, hidden=hidden, seed=seed,
                          max_position_embeddings=512,
                          **{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def tiny_llama(num_layers: int = 4, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    return tiny_causal_lm(VOCAB, arch="llama", num_layers=num_layers, hidden=hidden, seed=seed,
                          max_position_embeddings=512)


def tiny_qwen3_5(num_layers: int = 4, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    """A tiny hybrid target (Qwen3.5 text: gated delta-net linear attention + full attention)."""
    return tiny_causal_lm(VOCAB, arch="qwen3_5", num_layers=num_layers, hidden=hidden, seed=seed,
                          max_position_embeddings=512)


def tiny_qwen3_next(num_layers: int = 4, hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    """A tiny Qwen3-Next (gated delta-net + full attention, sparse-MoE MLPs), 1 full layer in 4."""
    return tiny_causal_lm(VOCAB, arch="qwen3_next", num_layers=num_layers, hidden=hidden, seed=seed,
                          max_position_embeddings=512)


@pytest.fixture
def target() -> TargetModel:
    return TargetModel(tiny_qwen3(), [1, 3, 5])


def make_drafter(target: TargetModel, num_layers: int = 2, block_size: int = 8, seed: int = 0) -> DFlashDrafter:
    drafter = DFlashDrafter.for_target(target, num_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID)
    drafter.reset_parameters(std=0.02, generator=torch.Generator().manual_seed(seed))
    return drafter.eval()


@pytest.fixture
def drafter(target) -> DFlashDrafter:
    return make_drafter(target)


# ---- multi-process jobs ------------------------------------------------------------
# Shared test helpers: launch real multi-process jobs the way torchrun would.
#
# Workers run tests/_workers.py scenarios. They are forked from one server process that has
# already imported torch (see ``_workers.serve``): a fresh interpreter per rank costs several
# seconds on 2 cores, a fork costs milliseconds, and the code under test runs unchanged.



REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "_workers.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ForkServer:
    """Starts worker processes (forked by the server) and reports their exit codes."""

    def __init__(self, log_dir: Path, preload: tuple[str, ...] = ()):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["OMP_NUM_THREADS"] = "1"
        self.log_dir = log_dir
        self.proc = subprocess.Popen([sys.executable, str(WORKERS), "serve", *preload], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.exits: dict[int, int] = {}
        self.started: list[int] = []
        self.cond = threading.Condition()
        self.count = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, *rest = line.split()
            with self.cond:
                if kind == "started":
                    self.started.append(int(rest[0]))
                elif kind == "exited":
                    self.exits[int(rest[0])] = int(rest[1])
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def spawn(self, scenario: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, Path]:
        """Start one worker; return (pid, path of its combined stdout/stderr)."""
        with self.cond:
            self.count += 1
            out = self.log_dir / f"worker{self.count}.log"
            n = len(self.started)
            self.proc.stdin.write(json.dumps({"scenario": scenario, "args": list(args), "env": env or {},
                                              "out": str(out)}) + "\n")
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: len(self.started) > n, timeout=60):
                pytest.fail("fork server did not start a worker within 60 s")
            return self.started[n], out

    def wait(self, pid: int, timeout: float) -> int | None:
        """The worker's exit code (negative: killed by that signal), or None on timeout."""
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits, timeout=timeout)
            return self.exits.get(pid)

    def kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.proc.stdin.close()  # the server SIGKILLs its remaining workers when stdin closes
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its workers are gone; skip the slow interpreter teardown
            self.proc.wait()


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory):
    """The session's one fork server. It has already imported the trainer (and transformers):
    every worker, a bare collective or a whole `flashdraft train`, starts in milliseconds instead
    of ~5 s of imports per rank on 2 cores."""
    server = ForkServer(tmp_path_factory.mktemp("workers"), preload=("flashdraft.train.trainer",))
    yield server
    server.close()


def run_ranks(server: ForkServer, scenario: str, *args: str, world_size: int = 2, timeout: float = 60,
              expect_exit: bool = True, env: dict[str, str] | None = None) -> list[tuple[int, Path]]:
    """Start ``world_size`` workers with torchrun's environment (plus ``env``); wait for all
    unless told not to."""
    port = str(free_port())
    workers = [server.spawn(scenario, *args, env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(env or {})})
               for r in range(world_size)]
    if expect_exit:
        deadline = time.monotonic() + timeout
        for pid, _ in workers:
            if server.wait(pid, max(0.0, deadline - time.monotonic())) is None:
                for p, _ in workers:
                    server.kill(p)
                pytest.fail(f"{scenario} timed out:\n" + "\n".join(read_log(o) for _, o in workers))
    return workers


def read_log(path: Path) -> str:
    """A worker's output so far ("" before the worker has created its log)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def results(workers: list[tuple[int, Path]]) -> list[dict]:
    """The ``RESULT {json}`` line of each worker, in rank order."""
    found = []
    for _, out in workers:
        text = read_log(out)
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"worker printed no RESULT:\n{text}"
        found.append(json.loads(lines[-1][len("RESULT "):]))
    return found


def pytest_collection_modifyitems(items):
    """Multi-process tests (those that start workers through a fork server) are ``slow``:
    ``pytest -m "not slow"`` leaves them out of the fast inner loop; CI runs them."""
    for item in items:
        if "forkserver" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config) -> None:
    """Under pytest-xdist, each worker and the processes it starts share its cores (their torch
    threads): N workers on N cores each running 2 threads spin on each other's cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, usable_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes this worker starts
        torch.set_num_threads(threads)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (addopts): a worker per core this process may use, at most 4: each worker holds
    its own fork server and session runs, and beyond 4 the engine check's one worker bounds the time."""
    return max(1, min(usable_cores(), 4))


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, as on Linux)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.fixture
def fresh_dist(monkeypatch):
    """Single-process torchrun-less environment; tears down any process group afterwards."""
    from flashdraft import distributed

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    distributed.teardown()
    yield distributed
    distributed.teardown()


# ---- the tiny training job shared by the trainer / pipeline / placement / fault tests ----------


@pytest.fixture(scope="session")
def tiny_job(tmp_path_factory) -> Path:
    """A saved tiny target and a dataset of its own greedy continuations (like regenerated data);
    one per session (tests write their runs elsewhere), so that reference runs of it are shared."""
    return make_job(tmp_path_factory.mktemp("job"), tiny_qwen3(num_layers=4, hidden=32, seed=1))


def make_job(root: Path, model) -> Path:
    """``model`` saved as root/target, train / heldout shards of its greedy continuations of
    random 6-token prompts, and the heldout prompts as eval prompts."""
    with torch.no_grad():  # a confident head: random init gives near-uniform logits no drafter could match
        model.lm_head.weight.mul_(30)
    model.save_pretrained(root / "target")
    prompts = torch.randint(0, 298, (40, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=34, do_sample=False)
    mask = np.r_[np.zeros(6), np.ones(34)]
    write_token_shard(root / "data", [(row.numpy(), mask) for row in out[:32]], vocab_size=300)
    write_token_shard(root / "heldout", [(row.numpy(), mask) for row in out[32:]], vocab_size=300)
    write_prompts(root / "prompts.jsonl", prompts[32:].tolist())
    return root


def overrides(job: Path, out: Path, **extra) -> list[str]:
    base = {
        "target.path": job / "target", "drafter.mask_token_id": 299, "drafter.num_layers": 1,
        "drafter.block_size": 4, "target.layer_ids": "[1,2]", "data.path": job / "data",
        "data.token_budget": 160, "data.max_batch_size": 4, "objective.num_anchors": 8, "optim.lr": "2e-3",
        "train.max_steps": 6, "train.log_every": 1, "checkpoint.save_every": 0, "train.output_dir": out,
        "train.device": "cpu", "train.deterministic": "true",
    }
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@dataclasses.dataclass
class Finished:
    """A finished reference run: its output directory and each rank's RESULT (_workers.train_ranks)."""

    out: Path
    ranks: list[dict]

    @property
    def losses(self) -> list[float]:
        return self.ranks[0]["losses"]


class References:
    """The uninterrupted runs of the tiny job that equivalence and resume tests compare with, each
    trained once per session however many tests ask for it: keyed by world size, config (its
    output directory aside) and whether the device group's p2p ops are recorded (in OUT/p2p,
    tests/p2p_model.py). A reference's directory is read, never written, by the tests."""

    def __init__(self, server: ForkServer, job: Path, root: Path):
        self.server, self.job, self.root = server, job, root
        self.runs: dict[tuple, Finished] = {}

    def __call__(self, world_size: int = 1, p2p: bool = False, **extra) -> Finished:
        key = (world_size, p2p, *overrides(self.job, Path("OUT"), **extra))
        if key not in self.runs:
            out = self.root / f"run{len(self.runs)}"
            env = {}
            if p2p:
                from p2p_model import ENV

                (out / "p2p").mkdir(parents=True)
                env[ENV] = str(out / "p2p")
            workers = run_ranks(self.server, "train_ranks", json.dumps(overrides(self.job, out, **extra)),
                                world_size=world_size, timeout=300, env=env)
            codes = [self.server.wait(pid, 0) for pid, _ in workers]
            assert codes == [0] * world_size, "\n".join(read_log(log) for _, log in workers)  # a clean end
            self.runs[key] = Finished(out, results(workers))
        return self.runs[key]


@pytest.fixture(scope="session")
def references(forkserver, tiny_job, tmp_path_factory) -> References:
    return References(forkserver, tiny_job, tmp_path_factory.mktemp("references"))


def final_drafter(out: Path) -> tuple[int, dict]:
    """(step, drafter state) of the newest checkpoint of the run in ``out``."""
    loaded = CheckpointManager(out / "checkpoints").load_latest()
    return loaded.step, loaded.parts["drafter"]


def supervised_runs(tok, ids, mask) -> list[str]:
    """The decoded runs of consecutive supervised (mask 1) tokens."""
    runs, run = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            run.append(t)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


# ---- eval_dir: a saved target, drafter and prompts (issue 31's eval, export, config, data, window tests) --


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    """A 4-layer target, a block-4 drafter of it, and two prompts."""
    d = tmp_path_factory.mktemp("eval_dir")
    model = tiny_qwen3(num_layers=4, seed=1)
    model.save_pretrained(d / "target")
    make_drafter(TargetModel(model, [1, 2]), num_layers=1, block_size=4).save_pretrained(d / "drafter")
    write_prompts(d / "prompts.jsonl", [[1, 2, 3, 4], [5, 6, 7]])
    return d
