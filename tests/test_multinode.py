"""Start-up, steps and resume at scale (issue 29), on 2 gloo ranks: what a many-node job pays
per step and at start-up, and that a slow rank or a second node never breaks the run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import flashdraft.target.model as target_mod
from conftest import REPO, WORKERS, free_port, overrides, read_log, results, run_ranks
from flashdraft.checkpoint import CheckpointManager


def test_each_step_votes_skip_and_stop_in_one_all_reduce(tiny_job, tmp_path, forkserver):
    """Between two optimizer steps a rank asks for two all-reduces: the loss normaliser (one
    number, read on the device) and the step's vote (two numbers: non-finite, stop; the one
    host sync). Before, the non-finite vote and the stop vote were an all-reduce each."""
    args = overrides(tiny_job, tmp_path / "run", train__max_steps=6, train__log_every=100)
    ranks = results(run_ranks(forkserver, "train_collectives", json.dumps(args), timeout=240))
    for r in ranks:
        assert len(r["per_step"]) == 6
        for step, ops in enumerate(r["per_step"][1:-1], start=2):  # the first holds start-up's, the last the log's
            assert ops == [["all_reduce", 1], ["all_reduce", 2]], f"step {step}: {ops}"


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_a_rank_loading_slower_than_the_collective_timeout_still_trains(tiny_job, tmp_path, forkserver,
                                                                       tensor_parallel):
    """Rank 1 reads its target 8 s late, past train.collective_timeout_s=4: the ranks meet at the
    start-up barrier (train.startup_timeout_s) before DDP's first broadcast, and both train.
    Before the barrier, rank 0's broadcast failed after 4 s. Sharded over both ranks, the target
    is gathered (its embedding and head) right after loading: the ranks meet first, host-side on
    the start-up clock (before, rank 0's gather failed after 4 s)."""
    args = overrides(tiny_job, tmp_path / "run", train__max_steps=2, train__collective_timeout_s=4,
                     target__tensor_parallel=tensor_parallel)
    ranks = results(run_ranks(forkserver, "train_slow_loader", json.dumps(args), "8", timeout=240))
    assert [(r["error"], r["steps"]) for r in ranks] == [(None, 2), (None, 2)]


def test_rank_0_verifying_the_checkpoint_longer_than_the_collective_timeout_still_resumes(tiny_job, tmp_path,
                                                                                          forkserver):
    """A resume's slow part, rank 0 hashing every checkpoint file (8 s here, past the 4 s
    collective timeout), comes before the start-up barrier: the other rank waits there, not in
    the collective that shares rank 0's choice (which failed after 4 s before)."""
    first = overrides(tiny_job, tmp_path / "run", train__max_steps=4, checkpoint__save_every=2)
    assert [r["error"] for r in results(run_ranks(forkserver, "train_slow_loader", json.dumps(first), "0",
                                                  timeout=240))] == [None, None]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")  # as if preempted after step 2
    (tmp_path / "run" / "checkpoints" / "latest").unlink(missing_ok=True)
    resumed = overrides(tiny_job, tmp_path / "run", train__max_steps=4, checkpoint__save_every=2,
                        train__collective_timeout_s=4)
    ranks = results(run_ranks(forkserver, "train_slow_loader", json.dumps(resumed), "8", "verify",
                              timeout=240))
    assert [(r["error"], r["steps"]) for r in ranks] == [(None, 4), (None, 4)]


def test_a_rank_later_than_the_startup_timeout_fails_the_job_with_a_named_error(tiny_job, tmp_path,
                                                                                  forkserver):
    args = overrides(tiny_job, tmp_path / "run", train__startup_timeout_s=2)
    ranks = results(run_ranks(forkserver, "train_slow_loader", json.dumps(args), "12", timeout=240))
    for r in ranks:
        assert r["error"] is not None and r["error"].startswith("StartupError: start-up barrier after loading"), r
        assert "train.startup_timeout_s = 2 s" in r["error"]
    assert "1" in ranks[0]["error"].split("(", 1)[1]  # rank 0 names the missing rank


def test_a_rank_killed_during_start_up_is_named_as_dead_not_as_slow(tiny_job, tmp_path, forkserver):
    """Rank 1 dies while loading its target: rank 0's barrier fails within a second or so, and its
    error says a rank died (it used to blame train.startup_timeout_s, after 0.7 s of a 3600 s one)."""
    args = overrides(tiny_job, tmp_path / "run", train__startup_timeout_s=600)
    workers = run_ranks(forkserver, "train_slow_loader", json.dumps(args), "0", "die", timeout=240)
    (survivor,) = results(workers[:1])
    assert survivor["error"].startswith("StartupError: start-up barrier after loading"), survivor
    assert re.search(r"rank 0 of 2 lost a peer after \d+\.\d s, long before train.startup_timeout_s=600 s .*a rank "
                     r"died during start-up; its log has the first error", survivor["error"]), survivor
    assert "raise train.startup_timeout_s" not in survivor["error"]
    assert "RESULT" not in read_log(workers[1][1])  # rank 1 died without a result


@pytest.mark.parametrize("flock", ["enosys", "per_node"])
def test_the_data_is_converted_by_rank_0_alone_whatever_the_filesystem_locks(tmp_path, forkserver, flock):
    """A parquet source opened by 2 ranks: rank 0 converts (3 s, past the 2 s collective
    timeout), rank 1 waits at the start-up barrier, both open the one shard. Before, the
    conversion was serialised by an flock: ENOSYS on Lustre failed every rank; per-node locks
    let both ranks convert, each replacing the shard under the other."""
    rows = [[i % 7 + 1] * (5 + i % 4) for i in range(24)]
    pq.write_table(pa.table({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]}), tmp_path / "train.parquet")
    marks = tmp_path / "marks"
    marks.mkdir()
    ranks = results(run_ranks(forkserver, "convert_once", str(tmp_path / "train.parquet"), str(marks), flock,
                              timeout=120))
    assert [(r["error"], r["samples"]) for r in ranks] == [(None, 24), (None, 24)]
    assert sorted(m.name for m in marks.iterdir()) == ["rank0"]


def test_a_failed_conversion_fails_every_rank_at_once(tmp_path, forkserver):
    """Rank 0's conversion raises (no loss_mask column): it still lets the others go, and they
    fail naming the missing shard instead of waiting for the start-up timeout (60 s)."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "bad.parquet")
    (tmp_path / "marks").mkdir()
    ranks = results(run_ranks(forkserver, "convert_once", str(tmp_path / "bad.parquet"), str(tmp_path / "marks"),
                              "per_node", timeout=50))
    assert "no column 'loss_mask'" in ranks[0]["error"]
    assert ranks[1]["error"].startswith("ValueError: ") and "no token shard after rank 0 converted" in ranks[1]["error"]


def test_the_target_is_loaded_straight_onto_its_device(tiny_job, monkeypatch):
    """transformers places each tensor on ``device_map`` as it reads it from the memory-mapped
    files; loading to the host and then moving made a whole host copy per local rank on a GPU
    node. On CPU both paths keep the tensors in the same mapped file pages (transformers 5
    makes no host copy there either way: peak RSS equal), so this checks the rule, not the RSS:
    the loader is told the device and nothing moves the model afterwards."""
    loads, moves, inside = [], [], [False]
    real_load, real_to = target_mod.AutoModelForCausalLM.from_pretrained, torch.nn.Module.to

    def load(*args, **kwargs):
        loads.append(kwargs.get("device_map"))
        inside[0] = True
        try:
            return real_load(*args, **kwargs)
        finally:
            inside[0] = False

    def to(module, *args, **kwargs):
        if not inside[0]:
            moves.append(type(module).__name__)
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(target_mod.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    target = target_mod.TargetModel.from_pretrained(tiny_job / "target", target_layer_ids=[1, 2], device="cpu")
    assert loads == [torch.device("cpu")] and moves == []
    assert all(p.device.type == "cpu" for p in target.model.parameters())


def test_a_resume_reads_each_shared_part_once(tmp_path, forkserver):
    """2 ranks load a checkpoint as a resume does: the replicated parts (the drafter, the
    optimizer) are read by rank 0 alone and broadcast; each rank reads its own per-rank part.
    Before, every rank read every part (~12.6 GB per rank at the 8B point)."""
    ranks = results(run_ranks(forkserver, "resume_reads", str(tmp_path / "ckpt"), timeout=120))
    assert all(r["same"] and r["step"] == 5 for r in ranks)
    assert ranks[0]["read"] == ["model.safetensors", "optimizer.safetensors", "rng_rank0.safetensors"]
    assert ranks[1]["read"] == ["rng_rank1.safetensors"]


def test_a_resume_streams_a_multi_gb_part_holding_it_once_per_rank(tmp_path, forkserver, capsys):
    """2 ranks resume a checkpoint whose optimizer part is 2 GiB: rank 0 reads it and streams it
    to rank 1 in messages of at most 64 MiB, each received in place. Each rank's resident set
    peaks at the part's size once (plus a few MiB), and every tensor equals what the unstreamed,
    rank-local load reads. Before, the part went as one pickled message: 512 MiB peaked 1543 MiB
    above the start on rank 0 and 2058 MiB on rank 1 (3x and 4x; 25 and 34 GB at the 8.4 GB
    AdamW part of the 8B point)."""
    import tempfile
    import zlib

    from flashdraft.distributed import HOST_CHUNK_BYTES

    # on tmpfs where there is one: this measures memory, and fsyncing 2 GiB to a disk takes seconds
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path) as root:
        part = torch.arange(2**29, dtype=torch.int32)  # 2 GiB, every 4 bytes distinct: a misplaced chunk shows
        CheckpointManager(root).save(1, {"optimizer": {"exp_avg": part, "step": torch.tensor(3.0)},
                                         "drafter": {"w": torch.ones(7)}})
        size = part.numel() * part.element_size()
        del part
        ranks = results(run_ranks(forkserver, "resume_peak_rss", root, timeout=300))
        unstreamed = CheckpointManager(root).load(Path(root) / "step_00000001")
    expected = {name: {k: zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy())) for k, t in state.items()}
                for name, state in unstreamed.parts.items()}
    with capsys.disabled():
        print(f"\nresume of a {size / 2**20:.0f} MiB part on 2 ranks: peak resident set above the start "
              + ", ".join(f"rank {r['rank']} {r['peak_above_mib']:.0f} MiB" for r in ranks))
    for r in ranks:
        assert r["step"] == 1 and r["digests"] == expected
        assert size / 2**20 <= r["peak_above_mib"] <= (size + HOST_CHUNK_BYTES) / 2**20, r["peak_above_mib"]


# ---- a multi-node rehearsal on one machine --------------------------------------------------


def _launch_nodes(args: list[str], logs: Path, run: str, step_sleep: float = 0.0) -> list[subprocess.Popen]:
    """Two torchrun launchers as two nodes would run them (--nnodes 2, one process each, static
    rendezvous on 127.0.0.1), each starting ``flashdraft train ARGS`` through the test worker
    (which paces its steps by ``step_sleep``)."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "FLASHDRAFT_TEST_STEP_SLEEP": str(step_sleep)}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                              "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                              "--max-restarts=0", str(WORKERS), "cli", "train", *args],
                             env=env, stdout=open(logs / f"{run}-node{node}.log", "w"), stderr=subprocess.STDOUT)
            for node in (0, 1)]


def _worker_of(launcher: subprocess.Popen) -> int:
    """The pid of the training process a torchrun launcher started."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _losses(out: Path) -> dict[int, float]:
    """Each step's logged loss; a step logged twice (before a kill, then after the resume) keeps
    the resumed run's."""
    found = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by the kill
            continue
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def test_two_nodes_start_checkpoint_lose_a_node_and_resume_exactly(tiny_job, tmp_path, references):
    """Two launchers with different node ranks share one output directory: they start (the
    start-up barrier), train, checkpoint every 2 steps; node 1's worker is SIGKILLed after the
    step-4 checkpoint, node 0's fails within the collective timeout and both launchers exit;
    restarted, the job resumes from the newest checkpoint and ends with every step's loss and
    the final weights equal to an uninterrupted 2-rank run's."""
    steps = 8
    reference = references(2, train__max_steps=steps).out
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = overrides(tiny_job, out, train__max_steps=steps, checkpoint__save_every=2, train__collective_timeout_s=20)
    nodes = _launch_nodes(args, logs, "first", step_sleep=1.0)
    manager, deadline = CheckpointManager(out / "checkpoints"), time.monotonic() + 300
    while not (out / "checkpoints" / "step_00000004" / "manifest.json").is_file():
        if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
            for n in nodes:
                n.kill()
            pytest.fail("no step-4 checkpoint:\n" + "\n".join(read_log(f) for f in sorted(logs.iterdir())))
        time.sleep(0.05)
    os.kill(_worker_of(nodes[1]), signal.SIGKILL)  # node 1 is lost
    codes = [n.wait(timeout=120) for n in nodes]
    assert all(c != 0 for c in codes), codes
    killed_at = manager.load_latest().step
    assert 4 <= killed_at < steps
    nodes = _launch_nodes(args, logs, "resumed")
    codes = [n.wait(timeout=300) for n in nodes]
    assert codes == [0, 0], "\n".join(read_log(f) for f in sorted(logs.iterdir()))
    assert f"resumed from step {killed_at}" in read_log(logs / "resumed-node0.log")
    assert _losses(out) == _losses(reference) and len(_losses(out)) == steps
    resumed, straight = manager.load_latest(), CheckpointManager(reference / "checkpoints").load_latest()
    assert resumed.step == straight.step == steps
    for name, value in straight.parts["drafter"].items():
        assert torch.equal(resumed.parts["drafter"][name], value), name
