"""The online trainer: learning, frozen target, distributed equivalence, exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, WORKERS, final_drafter, make_job, overrides, results, run_ranks, tiny_qwen3_5
from flashdraft.config import load_config
from flashdraft.train.trainer import Trainer, train


def test_training_lowers_the_loss_and_exports(tiny_job, tmp_path):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=30, train__log_every=5,
                                          optim__lr="1e-2", data__eval_path=tiny_job / "heldout",
                                          data__eval_prompts=tiny_job / "prompts.jsonl", train__eval_max_new_tokens=12))
    trainer = Trainer(cfg)
    result = trainer.fit()
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert result["eval_tau"] >= 1.0 and "eval_loss" in result
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("time/drafter_share" in line and "pipe/target_busy_ms" in line for line in lines)


def test_a_hybrid_linear_attention_target_trains_evaluates_and_exports(tmp_path_factory, tmp_path):
    """Qwen3.5-style target (gated delta-net layers + full attention), the whole job: taps from
    its forward, training, periodic eval by real draft / verify decoding (whose cache rewinds
    restore the recurrent states, target.rewind_cache), and an export whose config.json says
    the RoPE the drafter trained with."""
    job = make_job(tmp_path_factory.mktemp("hybrid"), tiny_qwen3_5(hidden=32, seed=1))
    cfg = load_config(overrides=overrides(job, tmp_path / "run", train__max_steps=20, optim__lr="1e-2",
                                          data__eval_prompts=job / "prompts.jsonl", train__eval_max_new_tokens=12))
    trainer = Trainer(cfg)
    result = trainer.fit()
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert result["eval_tau"] >= 1.0
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert "partial_rotary_factor" not in exported["rope_parameters"]


def test_target_gets_no_gradient_and_no_optimizer_state(tiny_job, tmp_path):
    trainer = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=2)))
    trainer.fit()
    assert all(p.grad is None and not p.requires_grad for p in trainer.target.parameters())
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainer.drafter.parameters()}
    assert not optimized & {id(p) for p in trainer.target.parameters()}
    assert len(trainer.optimizer.state) == len(list(trainer.drafter.parameters()))


def test_two_ranks_equal_one_rank_with_the_same_samples_per_step(tiny_job, tmp_path, forkserver):
    """2 ranks x micro-batch b == 1 rank x (2 micro-batches of b): same samples each step."""
    two = run_ranks(forkserver, "train_ranks", json.dumps(overrides(tiny_job, tmp_path / "two")), timeout=240)
    one = run_ranks(forkserver, "train_ranks", json.dumps(overrides(tiny_job, tmp_path / "one", train__grad_accum=2)),
                    world_size=1, timeout=240)
    r0, r1 = results(two)
    (single,) = results(one)
    assert r0["ddp"] == "DistributedDataParallel" and not r0["target_in_ddp"]
    assert all(r0["identical"]) and len(r0["identical"]) == 6  # bit-identical drafters after every step
    assert r0["losses"] == r1["losses"]
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5)


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_resume_after_sigkill_is_exact(tiny_job, tmp_path):
    straight = tmp_path / "straight"
    train(load_config(overrides=overrides(tiny_job, straight, train__max_steps=8, train__save_every=4)))
    step, reference = final_drafter(straight)
    assert step == 8

    resumed = tmp_path / "resumed"
    args = overrides(tiny_job, resumed, train__max_steps=8, train__save_every=4)
    env = dict(os.environ, PYTHONPATH=str(REPO), FLASHDRAFT_TEST_STEP_SLEEP="0.5", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(WORKERS), "cli", "train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = resumed / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert latest.read_text().strip().endswith("step_00000004"), proc.stderr.read().decode()[-2000:]
    train(load_config(overrides=args))
    step, weights = final_drafter(resumed)
    assert step == 8
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name
    assert _losses(resumed) == _losses(straight)
