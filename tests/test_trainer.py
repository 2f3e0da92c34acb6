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
    assert result["eval_tau_pooled"] >= 1.0  # both taus, the engines' pooled one too (docs/evaluation.md)
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("time/drafter_share" in line and "pipe/target_busy_ms" in line for line in lines)


@pytest.mark.parametrize("loss", ["ce", "lk_lambda"])
def test_a_dpace_run_with_a_sampled_eval_trains_and_evaluates(tiny_job, tmp_path, loss):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=20, optim__lr="1e-2",
                                          objective__weighting="dpace", objective__loss=loss,
                                          data__eval_prompts=tiny_job / "prompts.jsonl",
                                          train__eval_max_new_tokens=12, train__eval_temperature="1.0",
                                          train__eval_top_k=20))
    trainer = Trainer(cfg)
    result = trainer.fit()
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert result["eval_tau"] >= 1.0 and len(result["eval_acceptance"]) == 3


def test_a_sliding_window_drafter_trains_and_exports_the_keys_the_engines_read(tiny_job, tmp_path):
    from flashdraft.config import LayerMask
    from flashdraft.drafter import DFlashDrafter

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=12, optim__lr="1e-2",
                                          model__drafter_layer_types="[sliding_attention]",
                                          model__drafter_sliding_window=6, model__drafter_causal="false",
                                          data__eval_prompts=tiny_job / "prompts.jsonl", train__eval_max_new_tokens=8))
    trainer = Trainer(cfg)
    result = trainer.fit()
    assert trainer.drafter.layer_masks == [LayerMask(6, False)] and result["eval_tau"] >= 1.0
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["layer_types"] == ["sliding_attention"] and exported["sliding_window"] == 6
    assert exported["is_causal"] is False and exported["dflash_config"]["causal"] is False
    assert DFlashDrafter.from_pretrained(tmp_path / "run" / "drafter").layer_masks == [LayerMask(6, False)]


DFLASH2 = {"model__drafter": "dflash2", "model__conv_group_size": 8, "model__selector_rank": 8,
           "model__selector_top_k": 8}


def test_a_dflash2_drafter_trains_its_selector_evaluates_and_exports(tiny_job, tmp_path):
    """DFlash2 end to end: the selector term ramps in, trains the codebooks, the logs carry its CE
    and the candidates' recall, the periodic greedy and sampled evals walk the selector, and the
    export loads back as a DFlash2 drafter."""
    from flashdraft.drafter import DFlashDrafter

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=16, optim__lr="1e-2",
                                          objective__selector_warmup_frac="0.25", objective__selector_ramp_frac="0.25",
                                          train__log_every=1, data__eval_prompts=tiny_job / "prompts.jsonl",
                                          train__eval_max_new_tokens=8, train__eval_temperature="1.0", **DFLASH2))
    trainer = Trainer(cfg)
    alphas = []
    trainer_step = trainer.step_fn.blocks

    def record(micro, step, position):
        blocks = trainer_step(micro, step, position)
        alphas.append(blocks[0].selector.alpha)
        return blocks

    trainer.step_fn.blocks = record
    result = trainer.fit()
    # SpecForge's edges (docs: selector schedule): exactly the 4 warm-up steps at 0, the ramp's 4
    # steps end on alpha
    assert alphas[:4] == [0.0] * 4 and alphas[4:8] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and alphas[8:] == [1.0] * 8
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert all(0 <= h["topk_recall"] <= 1 and h["selector_loss"] >= 0 for h in trainer.history if "loss" in h)
    assert trainer.drafter.candidate_selector.successor_codebook.abs().sum() > 0  # trained from its zero start
    assert result["eval_tau"] >= 1.0
    exported = DFlashDrafter.from_pretrained(tmp_path / "run" / "drafter")
    assert exported.convolved and exported.candidate_selector.top_k == 8


def test_a_drafter_with_attention_sinks_trains_them_and_exports_them(tiny_job, tmp_path):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=6, optim__lr="1e-2",
                                          model__drafter_attention_sink="true"))
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.drafter.layers[0].self_attn.attention_sink_bias.abs().sum() > 0  # trained from 0
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["dflash_config"]["attention_sink_bias"] is True


def test_selector_alpha_0_freezes_the_selector(tiny_job, tmp_path):
    """No gradient, no optimizer state, unchanged weights; a resume with the selector trained
    again loads the same optimizer layout (every parameter is in it)."""
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=2, objective__selector_alpha=0,
                                          train__save_every=1, **DFLASH2))
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.drafter.candidate_selector.state_dict().items()}
    trainer.fit()
    selector = trainer.drafter.candidate_selector
    assert not any(p.requires_grad for p in selector.parameters())
    assert not any(p in trainer.optimizer.state for p in selector.parameters())
    assert all(torch.equal(before[k], v) for k, v in selector.state_dict().items())
    resumed = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=4,
                                                      train__save_every=1, **DFLASH2)))
    resumed.fit()
    assert resumed.step == 4
    assert any(p in resumed.optimizer.state for p in resumed.drafter.candidate_selector.parameters())


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


@pytest.mark.parametrize("weighting", ["decay", "dpace", "dflash2"])
def test_two_ranks_equal_one_rank_with_the_same_samples_per_step(tiny_job, tmp_path, forkserver, weighting):
    """2 ranks x micro-batch b == 1 rank x (2 micro-batches of b): same samples each step. With
    D-PACE too: its weights depend on the drafter's outputs, its normaliser (the scored-slot
    count) only on the data, so the split of a batch over ranks changes nothing. DFlash2 (with
    D-PACE): the selector, used by the loss outside DDP's forward, is all-reduced like the rest."""
    knobs = {"objective__weighting": weighting} if weighting != "dflash2" else {"objective__weighting": "dpace",
                                                                               **DFLASH2}
    two = run_ranks(forkserver, "train_ranks", json.dumps(overrides(tiny_job, tmp_path / "two", **knobs)), timeout=240)
    one = run_ranks(forkserver, "train_ranks", json.dumps(overrides(tiny_job, tmp_path / "one", train__grad_accum=2,
                                                                    **knobs)), world_size=1, timeout=240)
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


# ---- the budget belongs to the run, not to its world size -----------------------------------


def _recorded(server, out, world_size, stop_at=0, **extra):
    """(per-step [step, lr, sample ids of every rank], total steps) of a 3-epoch run (no max_steps)."""
    args = overrides(_tiny, out, train__max_steps="null", train__epochs=3, train__save_every=0, **extra)
    ranks = results(run_ranks(server, "train_recorded", json.dumps(args), str(stop_at), world_size=world_size,
                              timeout=240))
    steps = [[s, lr, sorted(i for r in ranks for i in r["steps"][k][2])] for k, (s, lr, _) in
             enumerate(ranks[0]["steps"])]
    return steps, ranks[0]["total_steps"]


def _epochs(steps, num_samples: int) -> int:
    """The number of whole epochs ``steps`` train, asserting that each is every sample exactly
    once (a step never spans two epochs: each epoch's plan is cut into its own steps)."""
    epochs, seen = 0, set()
    for step, _, ids in steps:
        assert not seen & set(ids) and len(set(ids)) == len(ids), f"step {step} trains a sample twice in an epoch"
        seen |= set(ids)
        if len(seen) == num_samples:
            epochs, seen = epochs + 1, set()
    assert not seen, f"the last epoch trained {len(seen)} of {num_samples} samples"
    return epochs


_tiny = None


@pytest.fixture
def epochs_job(tiny_job):
    global _tiny
    _tiny = tiny_job
    return tiny_job


@pytest.mark.parametrize("before,after", [((2, 1), (1, 1)), ((2, 1), (1, 2)), ((1, 1), (2, 1))],
                         ids=["2_ranks_to_1", "2x1_to_1x2", "1_rank_to_2"])
def test_a_resume_at_another_world_size_trains_exactly_the_samples_left(epochs_job, tmp_path, forkserver,
                                                                         before, after):
    """The step counter is kept, the budget recounted at the new layout: every sample is trained
    exactly once per epoch across both parts, the LR goes on where it was (no jump) and reaches
    the end of its schedule; 2 ranks x 1 -> 1 rank x 2 (the same samples per step) trains the
    uninterrupted run's samples at its learning rates, step by step."""
    (w0, ga0), (w1, ga1) = before, after
    straight, total = _recorded(forkserver, tmp_path / "straight", w0, train__grad_accum=ga0)
    assert len(straight) == total and total >= 8
    stop = total // 2 + 1
    out = tmp_path / "run"
    part1, _ = _recorded(forkserver, out, w0, stop, train__grad_accum=ga0)
    part2, total2 = _recorded(forkserver, out, w1, train__grad_accum=ga1)
    assert len(part1) == stop and part2[0][0] == stop + 1 and part2[-1][0] == total2
    assert _epochs(part1 + part2, 32) == 3  # each of the 32 samples once per epoch, none lost or replayed
    assert part2[0][1] == pytest.approx(straight[stop][1], rel=1e-12)  # the lr goes on where it was
    lrs = [lr for _, lr, _ in part1 + part2]
    assert all(b <= a + 1e-15 for a, b in zip(lrs[stop - 1:], lrs[stop:]))  # past warmup: decaying, never jumping
    assert lrs[-1] < 0.1 * max(lrs)  # the schedule reaches its end
    if (w0 * ga0, w1 * ga1) == (2, 2):  # the same samples per step: the uninterrupted run's steps exactly
        assert total2 == total and [ids for _, _, ids in part2] == [ids for _, _, ids in straight[stop:]]
        assert [lr for _, lr, _ in part2] == pytest.approx([lr for _, lr, _ in straight[stop:]], rel=1e-12)
