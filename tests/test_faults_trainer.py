"""Fault injection against the whole trainer (issue 8): `flashdraft train` processes are
preempted (SIGTERM), killed (SIGKILL) and starved of disk, and must resume exactly; NaNs come
from a real poisoned target; a rank of a 2-process gloo job dies or hangs.

End-to-end runs are forked from a server that has already imported the trainer
(``forkserver``), so each run starts in milliseconds; FLASHDRAFT_TEST_STEP_SLEEP paces
the loop so that kills land at chosen moments.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import overrides, read_log, results, run_ranks
from flashdraft.checkpoint import CheckpointManager, verify_checkpoint
from flashdraft.config import load_config
from flashdraft.data.shards import read_token_shard, write_token_shard
from flashdraft.train.trainer import Trainer, train

STEPS = 8
GRACE_S = 30.0  # a typical preemption grace period (Kubernetes' default)


def _metrics(out: Path) -> list[dict]:
    """metrics.jsonl records (a line torn by SIGKILL is skipped)."""
    records = []
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _metrics(out) if "loss" in r}


def _last_step(out: Path) -> int:
    return max((r["step"] for r in _metrics(out) if "loss" in r), default=0)


def _drafter(out: Path) -> tuple[int, dict]:
    loaded = CheckpointManager(out / "checkpoints").load_latest()
    return loaded.step, loaded.parts["drafter"]


def _wait_for(cond, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{read_log(log)[-3000:] if log else ''}")
        time.sleep(0.02)


@pytest.fixture
def straight(references) -> Path:
    """The uninterrupted reference run every interrupted run must reproduce exactly."""
    return references(train__max_steps=STEPS).out


def _assert_same_as_straight(out: Path, straight: Path) -> None:
    step, weights = _drafter(out)
    ref_step, reference = _drafter(straight)
    assert step == ref_step == STEPS
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name
    assert _losses(out) == _losses(straight)


def _spawn_train(server, args: list[str], sleep: float, **env: str) -> tuple[int, Path]:
    return server.spawn("cli", "train", *args, env={"FLASHDRAFT_TEST_STEP_SLEEP": str(sleep), **env})


# ---- preemption ---------------------------------------------------------------------------


def test_sigterm_at_a_random_step_checkpoints_exits_143_and_resumes_exactly(tiny_job, straight, tmp_path,
                                                                          forkserver):
    rng = random.Random(int(os.environ.get("FLASHDRAFT_FAULT_SEED", time.time_ns())))
    after_step, delay = rng.randint(1, STEPS - 3), rng.uniform(0, 0.3)
    out = tmp_path / "run"
    args = overrides(tiny_job, out, train__max_steps=STEPS)
    pid, log = _spawn_train(forkserver, args, sleep=0.3)
    _wait_for(lambda: _last_step(out) >= after_step, 120, f"step {after_step}", log)
    time.sleep(delay)
    os.kill(pid, signal.SIGTERM)
    sent = time.monotonic()
    code = forkserver.wait(pid, GRACE_S)
    waited = time.monotonic() - sent
    text = read_log(log)
    assert code == 128 + signal.SIGTERM, \
        f"exit {code} after SIGTERM (after step {after_step} + {delay:.2f} s):\n{text[-3000:]}"
    assert waited < GRACE_S
    stopped = _last_step(out)
    assert f"stopped by signal at step {stopped}; checkpoint saved" in text
    saved = out / "checkpoints" / f"step_{stopped:08d}"
    assert (f"flashdraft train: stopped by SIGTERM at step {stopped} of {STEPS}: checkpoint {saved} saved; run the "
            "same command again to resume from it") in text
    assert CheckpointManager(out / "checkpoints").load_latest().step == stopped < STEPS
    train(load_config(overrides=args))  # the restarted job
    _assert_same_as_straight(out, straight)


def test_sigterm_during_the_final_eval_still_saves_and_exits_143(tiny_job, tmp_path, forkserver):
    """The final eval and save run after the loop; a preemption there used to kill the process
    (default SIGTERM action) before the final checkpoint."""
    out = tmp_path / "run"
    args = overrides(tiny_job, out, train__max_steps=2, eval__prompts_path=tiny_job / "prompts.jsonl",
                     eval__max_new_tokens=120)  # a final eval long enough to be hit
    pid, log = _spawn_train(forkserver, args, sleep=0)
    _wait_for(lambda: _last_step(out) >= 2, 120, "the last step", log)
    os.kill(pid, signal.SIGTERM)
    code = forkserver.wait(pid, GRACE_S)
    text = read_log(log)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert CheckpointManager(out / "checkpoints").load_latest().step == 2
    assert (out / "drafter" / "model.safetensors").is_file()
    assert "stopped by SIGTERM after the last step (2)" in text and "the run is complete" in text


# ---- crashes ------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["off", "on"])
def test_ten_sigkills_including_during_checkpoint_writes_resume_from_newest_complete(
        tiny_job, straight, tmp_path, forkserver, cache):
    """One run, killed 10 times at random moments: during start-up, mid-step, and while a
    checkpoint is being written (a ``.tmp-*`` dir exists). After each kill every visible
    checkpoint verifies, and the restart resumes from the newest complete one. Once it is left
    to finish, weights and every logged loss equal the uninterrupted run's (with the feature
    cache on: to float rounding, docs/pipeline.md)."""
    rng = random.Random(int(os.environ.get("FLASHDRAFT_FAULT_SEED", time.time_ns())))
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    extra = {"pipeline__feature_cache_bytes": 10**7} if cache == "on" else {}
    args = overrides(tiny_job, out, train__max_steps=STEPS, checkpoint__save_every=1, checkpoint__keep_last=2, **extra)
    moments = []
    for trial in range(10):
        newest_before = CheckpointManager(ckpts).latest_complete()
        kind = ("write", "step", "anytime")[trial % 3]
        # A write's temp dir lives milliseconds; stretched to 0.2 s for the write kills, so that
        # the poll below sees it on a busy machine too (it once missed every write of a run).
        pid, log = _spawn_train(forkserver, args, sleep=0.1,
                                FLASHDRAFT_TEST_WRITE_SLEEP="0.2" if kind == "write" else "0")
        if kind == "write":  # the moment a checkpoint's temp dir appears
            _wait_for(lambda pid=pid: any(ckpts.glob(f".tmp-step_*-{pid}"))
                      or forkserver.exits.get(pid) is not None, 120, "a checkpoint write", log)
        elif kind == "step":  # mid-step, after the restarted run trained a step
            start = _last_step(out)
            _wait_for(lambda pid=pid, start=start: _last_step(out) > start
                      or forkserver.exits.get(pid) is not None, 120, "a step", log)
            time.sleep(rng.uniform(0, 0.1))
        else:  # start-up included
            time.sleep(rng.uniform(0, 1.5))
        forkserver.kill(pid)
        code = forkserver.wait(pid, 30)
        text = read_log(log)
        moments.append((kind, code, bool(list(ckpts.glob(f".tmp-step_*-{pid}")))))
        if newest_before is not None and "resumed from step" in text:
            assert f"resumed from step {int(newest_before.name[5:])} " in text, text[-2000:]
        for p in CheckpointManager(ckpts).checkpoints():  # no step dir is ever partial
            verify_checkpoint(p)
        if code == 0:  # finished before this kill: nothing left to interrupt
            break
    print("kill moments (kind, exit code, mid-write):", moments)
    assert any(kind == "write" and mid_write for kind, _, mid_write in moments), \
        f"no kill landed during a checkpoint write: {moments}"
    newest = CheckpointManager(ckpts).latest_complete()
    pid, log = _spawn_train(forkserver, args, sleep=0)
    assert forkserver.wait(pid, 180) == 0, read_log(log)[-3000:]
    if newest is not None:
        assert f"resumed from step {int(newest.name[5:])} " in read_log(log)
    if cache == "off":
        _assert_same_as_straight(out, straight)
    else:
        step, weights = _drafter(out)
        assert step == STEPS
        for name, value in _drafter(straight)[1].items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)
        losses, reference = _losses(out), _losses(straight)
        assert sorted(losses) == sorted(reference)
        np.testing.assert_allclose([losses[k] for k in sorted(losses)], [reference[k] for k in sorted(reference)],
                                   rtol=1e-5)


# ---- disk full ----------------------------------------------------------------------------


def test_disk_full_at_save_time_stops_with_a_clear_error_and_keeps_the_previous_checkpoint(
        tiny_job, tmp_path, forkserver):
    """After the step-2 checkpoint the process may no longer write files larger than a few KB
    (RLIMIT_FSIZE: writes fail with EFBIG, like ENOSPC). The step-4 save must fail loudly, leave
    step 2 and `latest` intact, and the run must stop there instead of training on unsaved."""
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    args = overrides(tiny_job, out, train__max_steps=STEPS, checkpoint__save_every=2, train__log_every=1)
    pid, log = _spawn_train(forkserver, args, sleep=0.3, FLASHDRAFT_TEST_IGNORE_SIGXFSZ="1")
    _wait_for(lambda: (ckpts / "latest").exists(), 120, "the first checkpoint", log)
    drafter_bytes = (ckpts / "step_00000002" / "drafter.safetensors").stat().st_size
    limit = max(os.path.getsize(log), (out / "metrics.jsonl").stat().st_size) + 16384
    assert drafter_bytes > limit  # the next checkpoint cannot fit; the logs still can
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, limit))
    code = forkserver.wait(pid, 120)
    text = read_log(log)
    assert code == 1, text[-3000:]
    assert "could not save checkpoint step 4" in text and "File too large" in text, text[-3000:]
    assert "Previous checkpoints and 'latest' are unchanged" in text
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    verify_checkpoint(ckpts / "step_00000002")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # no partial left behind
    assert _last_step(out) == 4  # did not go on training as if it had saved


# ---- non-finite values ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poisoned_job(tiny_job, tmp_path_factory) -> tuple[Path, int]:
    """The tiny target with a NaN embedding row for one token id unused by the data, and the
    training data with that token planted in the prompt of one sample (source row 5)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("poisoned")
    meta, ids, mask, offsets = read_token_shard(tiny_job / "data")
    poison = int(np.setdiff1d(np.arange(1, 298), np.asarray(ids))[0])
    model = AutoModelForCausalLM.from_pretrained(tiny_job / "target")
    with torch.no_grad():
        model.get_input_embeddings().weight[poison] = float("nan")
    model.save_pretrained(root / "target")
    samples = [(np.array(ids[offsets[i]:offsets[i + 1]]), np.array(mask[offsets[i]:offsets[i + 1]]))
               for i in range(len(offsets) - 1)]
    samples[5][0][2] = poison  # a prompt token: no label is poisoned, only the target's features
    write_token_shard(root / "data", samples, vocab_size=300)
    return root, 5


def _poisoned_overrides(tiny_job, poisoned_job, out, **extra):
    root, _ = poisoned_job
    return overrides(tiny_job, out, target__path=root / "target", data__path=root / "data", **extra)


def test_nonfinite_features_skip_the_step_count_it_and_name_sample_and_stage(tiny_job, poisoned_job, tmp_path,
                                                                             caplog):
    # 8 steps of 4 samples = one epoch: the poisoned sample is in exactly one step.
    trainer = Trainer(load_config(overrides=_poisoned_overrides(tiny_job, poisoned_job, tmp_path / "run",
                                                                train__max_steps=8)))
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.skipped_steps == 1
    warning = next(r.getMessage() for r in caplog.records if "non-finite" in r.getMessage())
    assert "stage target forward: non-finite target features for samples [5]" in warning
    assert str(poisoned_job[0] / "data") in warning and "weights unchanged" in warning
    assert all(torch.isfinite(p).all() for p in trainer.drafter.parameters())
    logged = [h for h in trainer.history if "loss" in h]
    assert all(np.isfinite(h["loss"]) for h in logged)  # the skipped step's NaN stays out of the metrics
    assert logged[-1]["skipped_steps"] == 1


def test_nonfinite_steps_beyond_the_limit_stop_the_run_with_a_diagnostic(tiny_job, poisoned_job, tmp_path):
    trainer = Trainer(load_config(overrides=_poisoned_overrides(
        tiny_job, poisoned_job, tmp_path / "run", train__max_steps=8, train__max_nonfinite_steps=0)))
    with pytest.raises(FloatingPointError, match=r"(?s)step \d+: non-finite.*samples \[5\].*"
                                                 r"More than train.max_nonfinite_steps=0 skipped: stopping"):
        trainer.fit()
    assert trainer.skipped_steps == 1


# ---- a rank dies or hangs -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_dead_or_hung_rank_fails_the_other_within_the_collective_timeout(tiny_job, tmp_path, forkserver,
                                                                           how):
    timeout_s = 5.0
    args = overrides(tiny_job, tmp_path / "run", train__collective_timeout_s=timeout_s)
    mark = tmp_path / "fault_time"
    workers = run_ranks(forkserver, "train_rank_fails", json.dumps(args), how, "3", str(mark),
                        expect_exit=False)
    (pid0, log0), (pid1, _) = workers
    code = forkserver.wait(pid0, 120)
    forkserver.kill(pid1)  # the hung rank (torchrun would tear it down once rank 0 exits)
    assert code == 1, read_log(log0)[-3000:]
    (r0,) = results(workers[:1])
    waited = r0["exit_time"] - float(mark.read_text())
    assert "CollectiveError" in r0["error"] and "rank 0/2" in r0["error"], r0["error"]
    assert f"train.collective_timeout_s = {timeout_s:g} s" in r0["error"]
    assert "peer rank probably died or hung" in r0["error"]
    assert waited < timeout_s + 10, f"rank 0 took {waited:.1f} s to exit after the fault"


# ---- issue 31, 4: a bf16 / fp16 target trains on CPU ---------------------------------------------

@pytest.mark.parametrize("dtype, family", [("bfloat16", "dflash"), ("float16", "dflash2")])
def test_a_half_precision_target_trains_on_cpu(tiny_job, tmp_path, dtype, family):
    """The fp32 drafter met the target's bf16 / fp16 features in its fc at step 1 (autocast was
    used on CUDA only): CPU autocasts to the target's dtype now."""
    import math

    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    sizes = dict(drafter__conv_group_size=8, drafter__selector_rank=8, drafter__selector_top_k=4)
    extra = sizes if family == "dflash2" else {}
    result = train(load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=2, target__dtype=dtype,
                                                   drafter__family=family, **extra))).metrics
    assert math.isfinite(result["loss"]) and (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()


# ---- issue 31, 9: a run whose every step was skipped logs no loss, not a perfect one -------------

def test_a_run_whose_every_step_was_skipped_logs_no_loss_or_accuracy(tiny_job, tmp_path, capsys):
    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    out = tmp_path / "run"  # lambda = 1e300 * exp(...): an infinite loss at every step, each one skipped
    result = train(load_config(overrides=overrides(tiny_job, out, train__max_steps=2, objective__loss="lk_lambda",
                                                   objective__lk_kl_scale="1e300"))).metrics
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "skipped_steps" in r]
    assert [r["skipped_steps"] for r in steps] == [1, 2]
    assert not any(key in r for r in steps for key in ("loss", "acc", "acc_first", "tau_sim"))
    assert "loss" not in result and result["skipped_steps"] == 2
    err = capsys.readouterr().err
    assert "step 2/2 skipped 2 lr" in err and "loss 0" not in err
