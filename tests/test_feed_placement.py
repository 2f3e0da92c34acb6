"""Disaggregated placement: target ranks feed drafter ranks over real gloo process groups."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from conftest import final_drafter, overrides, read_log, results, run_ranks
from flashdraft.checkpoint import CheckpointManager
from flashdraft.config import load_config
from flashdraft.distributed import role_layout
from p2p_model import ENV as P2P_LOG
from p2p_model import Op, assert_one_way_and_nccl_safe, flow_violations, nccl_deadlocks
from test_equivalence import LAYOUTS


def disaggregated(job, out, target_ranks: int = 1, **extra) -> list[str]:
    return overrides(job, out, **{"pipeline__placement": "disaggregated", "pipeline__target_ranks": target_ranks,
                                  "train__collective_timeout_s": 60, **extra})


def test_a_failing_target_rank_ends_every_rank_with_an_error(tiny_job, tmp_path, forkserver):
    args = disaggregated(tiny_job, tmp_path / "run", train__max_steps=8, train__collective_timeout_s=30)
    workers = run_ranks(forkserver, "train_target_raises", json.dumps(args), "3", world_size=3, timeout=240)
    logs = "\n".join(read_log(out) for _, out in workers)
    codes = [forkserver.wait(pid, 0) for pid, _ in workers]
    assert codes == [1, 1, 1], logs
    d0, d1, target = results(workers)
    assert "injected target failure" in target["error"]
    assert d0["error"] and d1["error"]
    # The first drafter rank to get the target rank's ABORT names the cause; the other one may
    # fail first on its DDP peer's closed connection (a CollectiveError).
    assert any("target rank 2 failed" in d["error"] and "injected target failure" in d["error"] for d in (d0, d1)), logs


def test_sigterm_to_every_rank_checkpoints_exits_143_and_resumes_exactly(tiny_job, tmp_path, forkserver, references):
    """Preemption as torchrun delivers it (SIGTERM to every worker) in the middle of a
    disaggregated job: target and drafter ranks agree on a stop step, the checkpoint is
    written, every rank exits 143 (128 + SIGTERM), and the restarted job ends exactly where an uninterrupted one
    does (test_equivalence.py's disaggregated layout, which saves at step 4 too)."""
    server = forkserver
    straight = LAYOUTS["disaggregated_1_target_2_drafters"].run.of(references).out
    out = tmp_path / "run"
    args = disaggregated(tiny_job, out, train__max_steps=8)
    workers = run_ranks(server, "cli", "train", *args, world_size=3, expect_exit=False,
                        env={"FLASHDRAFT_TEST_STEP_SLEEP": "0.3"})
    deadline = time.monotonic() + 120
    while _logged_steps(out) < 3:
        if time.monotonic() > deadline:
            pytest.fail("no step 3:\n" + "\n".join(read_log(o) for _, o in workers))
        time.sleep(0.05)
    for pid, _ in workers:
        os.kill(pid, signal.SIGTERM)
    codes = [server.wait(pid, 60) for pid, _ in workers]
    logs = "\n".join(read_log(o) for _, o in workers)
    assert codes == [128 + signal.SIGTERM] * 3, logs
    stopped = CheckpointManager(out / "checkpoints").load_latest().step
    assert 3 <= stopped < 8, logs
    assert f"stopped by signal at step {stopped}; checkpoint saved" in logs
    resumed = run_ranks(server, "cli", "train", *args, world_size=3, timeout=300)
    assert [server.wait(pid, 0) for pid, _ in resumed] == [0, 0, 0]
    step, weights = final_drafter(out)
    ref_step, reference = final_drafter(straight)
    assert step == ref_step == 8
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name


def test_a_stop_from_the_drafter_ranks_reaches_the_target_rank_mid_run(tiny_job, tmp_path, forkserver):
    """SIGTERM to the drafter ranks only: their STOP must reach the target rank while it serves
    (on gloo a posted receive's completion shows only to a wait: a watcher thread waits for it),
    so it stops computing features within a few steps instead of serving all 40 for the drafter
    ranks to drain."""
    server, out = forkserver, tmp_path / "run"
    workers = _paced_job_at_step_2(server, tiny_job, tmp_path, out, max_steps=40)
    for pid, _ in workers[:2]:  # the drafter ranks; the target rank (2) gets no signal
        os.kill(pid, signal.SIGTERM)
    codes = [server.wait(pid, 60) for pid, _ in workers]
    logs = "\n".join(read_log(o) for _, o in workers)
    assert codes[:2] == [128 + signal.SIGTERM] * 2 and codes[2] in (0, 128 + signal.SIGTERM), logs
    stopped = CheckpointManager(out / "checkpoints").load_latest().step
    assert 2 <= stopped < 40, logs
    ops = assert_one_way_and_nccl_safe(tmp_path / "p2p", senders={2})
    served = sum(op.kind == "send" and op.group == "device" and op.peer == 0 for op in ops[2]) // 4
    # the steps trained, plus what the link and the stages hold ahead (3 x capacity): far from 40
    assert served <= stopped + 3 * 2 + 2, (served, stopped)


def _paced_job_at_step_2(server, job, tmp_path, out, max_steps: int) -> list:
    """A disaggregated job of 3 ranks (the last the target rank), its steps paced at 0.3 s and
    its device-group ops recorded in tmp_path / "p2p", once it has logged step 2."""
    (tmp_path / "p2p").mkdir()
    workers = run_ranks(server, "cli", "train", *disaggregated(job, out, train__max_steps=max_steps), world_size=3,
                        expect_exit=False, env={"FLASHDRAFT_TEST_STEP_SLEEP": "0.3", P2P_LOG: str(tmp_path / "p2p")})
    deadline = time.monotonic() + 120
    while _logged_steps(out) < 2:
        if time.monotonic() > deadline:
            pytest.fail("no step 2:\n" + "\n".join(read_log(o) for _, o in workers))
        time.sleep(0.05)
    return workers


def _logged_steps(out) -> int:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(ln).get("step", 0) for ln in lines if ln.endswith("}")), default=0)


@pytest.mark.parametrize(("world", "targets", "match"), [
    (3, 3, "must be a positive multiple of target_ranks"),
    (5, 2, "must be a positive multiple of target_ranks"),
])
def test_bad_role_layout_names_the_fix(world, targets, match):
    with pytest.raises(ValueError, match=match):
        role_layout(world, targets)


def test_role_layout_pairs_targets_with_consecutive_drafter_ranks():
    assert role_layout(4, 2) == ([0, 1], [2, 3])
    assert role_layout(7, 1) == ([0, 1, 2, 3, 4, 5], [6])


def test_disaggregated_needs_several_processes(tiny_job, tmp_path, fresh_dist):
    from flashdraft.train.trainer import Trainer

    with pytest.raises(ValueError, match="torchrun --nproc-per-node=2 or more"):
        Trainer(load_config(overrides=disaggregated(tiny_job, tmp_path / "run")))


def test_target_ranks_must_be_positive():
    with pytest.raises(ValueError, match="pipeline.target_ranks=0 is invalid"):
        load_config(overrides=["pipeline.target_ranks=0"])


def test_a_signal_to_the_target_rank_alone_stops_the_whole_job_with_a_checkpoint(tiny_job, tmp_path,
                                                                                   forkserver):
    """A preempted target node: its signal reaches the drafter ranks with the next step, they
    checkpoint and stop, and every rank exits 143 (before: the drafters trained on, the target
    rank then failed the finished job)."""
    server, out = forkserver, tmp_path / "run"
    workers = _paced_job_at_step_2(server, tiny_job, tmp_path, out, max_steps=12)
    os.kill(workers[2][0], signal.SIGTERM)  # the last rank is the target rank
    codes = [server.wait(pid, 60) for pid, _ in workers]
    logs = "\n".join(read_log(o) for _, o in workers)
    assert codes == [128 + signal.SIGTERM] * 3, logs
    stopped = CheckpointManager(out / "checkpoints").load_latest().step
    assert 2 <= stopped < 12 and f"stopped by SIGTERM at step {stopped} of 12" in logs
    # STOP, the drain up to END: the control messages never touched the device group.
    assert_one_way_and_nccl_safe(tmp_path / "p2p", senders={2})


def _link_trace(old: bool, steps: int = 2) -> dict[int, list[Op]]:
    """The device-group ops of one link (target rank 1 -> drafter rank 0, one micro-batch per
    step of 4 tensors), as the protocol before the control channel posted them (``old``: HELLO,
    header and control message on the device group, the STOP/DONE receive posted at the start)
    and as it does now (the features alone)."""
    def op(rank, kind, numel, dtype="torch.int64"):
        return Op(rank, kind, 1 - rank, "device", dtype, numel)

    payload = [("torch.int64", 12), ("torch.uint8", 12), ("torch.int64", 12), ("torch.bfloat16", 12 * 64)]
    target, drafter = [], []
    if old:
        target += [op(1, "recv", 13), op(1, "recv", 1)]  # HELLO, then the long-lived control receive
        drafter += [op(0, "send", 13)]
    for _ in range(steps):
        if old:
            target.append(op(1, "send", 30))  # the header
            drafter.append(op(0, "recv", 30))
        target += [op(1, "send", n, dt) for dt, n in payload]
        drafter += [op(0, "recv", n, dt) for dt, n in payload]
    if old:
        drafter.append(op(0, "send", 1))  # DONE
    return {0: drafter, 1: target}


def test_the_nccl_model_flags_the_old_link_and_passes_the_new_one():
    """NCCL runs a pair's p2p ops in posting order on one stream: the old protocol's control
    receive, posted before the first header send, meets the drafter's header receive -- two
    receives at the heads, a deadlock at the first step (gloo never showed it)."""
    old = nccl_deadlocks(_link_trace(old=True))
    assert len(old) == 1 and "deadlock at their op #1" in old[0] and "rank 1 waits in recv of 1" in old[0], old
    assert "rank 0 waits in recv of 30" in old[0]
    assert flow_violations(_link_trace(old=True), senders={1})  # a receive by the sender, sends by the drafter
    new = _link_trace(old=False)
    assert nccl_deadlocks(new) == [] and flow_violations(new, senders={1}) == []
    # The model also catches a size mismatch and a side that stops posting early.
    short = {0: new[0][:-1], 1: new[1]}
    assert "nothing more to post" in nccl_deadlocks(short)[0]
    swapped = {0: new[0][1:] + new[0][:1], 1: new[1]}
    assert nccl_deadlocks(swapped)
