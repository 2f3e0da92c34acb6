"""Targets sharded over several ranks (target.tensor_parallel, target.expert_parallel): the sharded
target's taps and decoding forward against the same target loaded whole, on 2 and 4 gloo ranks
(target groups of 2 and 4, and 2 groups of 2 side by side); evaluation and the failure of a rank
in a target group. Training with a sharded target, and resuming at another tensor-parallel size:
test_equivalence.py."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import VOCAB, overrides, read_log, results, run_ranks
from flashdraft.checkpoint import CheckpointManager
from flashdraft.toy import tiny_causal_lm


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny saved targets of each architecture a plan covers here: dense Qwen3, Qwen3-MoE, Llama,
    hybrid Qwen3.5 (heads, KV heads and experts divisible by 4, the widest group tested)."""
    root = tmp_path_factory.mktemp("tp_targets")
    paths = {}
    for arch in ("qwen3", "qwen3_moe", "llama", "qwen3_5"):
        model = tiny_causal_lm(VOCAB, arch=arch, num_layers=4, hidden=64, num_heads=4, num_kv_heads=4, seed=3,
                               max_position_embeddings=256)
        model.save_pretrained(root / arch)
        paths[arch] = root / arch
    return paths


@pytest.mark.parametrize("world,tp", [(2, 2), (4, 4)])  # groups of 2 and 4 (2 groups side by side: the training tests)
def test_a_sharded_target_computes_the_taps_and_logits_of_the_whole_one(targets, forkserver, world, tp):
    """Dense Qwen3, Qwen3-MoE with its experts tensor-parallel and expert-parallel, Llama, and the
    hybrid Qwen3.5 (its plan shards attention and gathers the linear-attention projections; its
    cache rewind restores the recurrent states): every layout, one launch each."""
    cases = [[str(targets[arch]), ep] for arch, ep in
             (("qwen3", False), ("qwen3_moe", False), ("qwen3_moe", True), ("llama", False), ("qwen3_5", False))]
    ranks = results(run_ranks(forkserver, "sharded_features", json.dumps(cases), str(tp), world_size=world,
                              timeout=300))
    for rank, found in enumerate(ranks):
        assert len(found) == len(cases)
        for r in found:
            assert r["sharded"] and r["data_rank"] == rank // tp
            assert r["features_err"] < 1e-5 and r["decode_err"] < 1e-5 and r["head_err"] == 0, r
            assert r["local_params"] < 0.75 * r["whole_params"], r  # the layers' weights split over the group


def test_greedy_eval_with_a_sharded_target_is_lossless_and_gives_the_unsharded_tau(tiny_job, tmp_path, forkserver,
                                                                                   references):
    trained = references().out  # the one-process run of the tiny job
    args = ["eval", "--target", str(tiny_job / "target"), "--drafter", str(trained / "drafter"),
            "--prompts", str(tiny_job / "prompts.jsonl"), "--max-new-tokens", "24", "--device", "cpu"]
    whole = run_ranks(forkserver, "cli", *args, "--output", str(tmp_path / "whole.json"), world_size=1, timeout=300)
    sharded = run_ranks(forkserver, "cli", *args, "--tensor-parallel", "2", "--output", str(tmp_path / "tp.json"),
                        timeout=300)
    assert whole and sharded
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("whole.json", "tp.json"))
    assert a["lossless"] and b["lossless"]
    assert b["tau"] == a["tau"] and b["per_position_acceptance"] == a["per_position_acceptance"]
    sharding = b["target_sharding"]
    assert sharding["ranks"] == 2 and sharding["weight_bytes_per_rank"] < 0.75 * sharding["weight_bytes_unsharded"]


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_rank_lost_in_a_target_group_fails_the_job_with_a_named_error(tiny_job, tmp_path, forkserver, how):
    """Rank 1 dies, or hangs, inside a sharded target forward: rank 0, waiting in that forward's
    collective, fails with the operation named within the collective timeout, never a hang."""
    timeout_s = 5.0
    args = overrides(tiny_job, tmp_path / "run", train__collective_timeout_s=timeout_s, target__tensor_parallel=2)
    mark = tmp_path / "fault_time"
    workers = run_ranks(forkserver, "train_rank_fails", json.dumps(args), how, "3", str(mark), expect_exit=False)
    (pid0, log0), (pid1, _) = workers
    code = forkserver.wait(pid0, 120)
    forkserver.kill(pid1)
    assert code == 1, read_log(log0)[-3000:]
    (r0,) = results(workers[:1])
    assert "CollectiveError" in r0["error"] and "tensor-parallel target forward" in r0["error"], r0["error"]
    assert r0["exit_time"] - float(mark.read_text()) < timeout_s + 10


def test_a_group_size_the_heads_do_not_divide_is_refused_with_the_sizes_that_fit():
    from flashdraft.target.model import _check_divisible
    from flashdraft.toy import causal_lm_config

    config = causal_lm_config(VOCAB, arch="qwen3_moe", num_heads=8, num_kv_heads=2)
    _check_divisible("T", config, 2, expert_parallel=True)  # 8, 2 and 4 experts: fine
    with pytest.raises(ValueError, match=r"tensor_parallel=4 must divide the target's num_key_value_heads=2 .* use 2"):
        _check_divisible("T", config, 4, expert_parallel=False)
    with pytest.raises(ValueError, match="num_experts=4"):
        _check_divisible("T", causal_lm_config(VOCAB, arch="qwen3_moe", num_heads=8, num_kv_heads=8), 8,
                         expert_parallel=True)


def test_a_signal_to_a_rank_of_a_disaggregated_target_group_stops_the_whole_job_with_a_checkpoint(
        tiny_job, tmp_path, forkserver):
    """Rank 2, the second rank of the target group {1, 2} (it sends nothing): its SIGTERM reaches
    the group's first rank through the group's per-step vote, then the drafter rank with the
    next step; it checkpoints, and every rank exits 143."""
    server, out = forkserver, tmp_path / "run"
    args = overrides(tiny_job, out, train__max_steps=12, target__tensor_parallel=2, pipeline__placement="disaggregated",
                     pipeline__target_ranks=2, train__collective_timeout_s=60)
    workers = run_ranks(server, "cli", "train", *args, world_size=3, expect_exit=False,
                        env={"FLASHDRAFT_TEST_STEP_SLEEP": "0.3"})
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        if time.monotonic() > deadline:
            pytest.fail("no step 2:\n" + "\n".join(read_log(o) for _, o in workers))
        time.sleep(0.05)
    os.kill(workers[2][0], signal.SIGTERM)
    codes = [server.wait(pid, 90) for pid, _ in workers]
    logs = "\n".join(read_log(o) for _, o in workers)
    assert codes == [128 + signal.SIGTERM] * 3, logs
    stopped = CheckpointManager(out / "checkpoints").load_latest().step
    assert 2 <= stopped < 12 and f"stopped by SIGTERM at step {stopped} of 12" in logs
