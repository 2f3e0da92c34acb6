"""The online trainer: learning, frozen target, exact resume after SIGKILL (the multi-process
layouts and resumes in other layouts: test_equivalence.py)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import final_drafter, make_job, overrides, read_log, tiny_qwen3_5
from flashdraft.config import load_config
from flashdraft.train.trainer import Trainer, train


def test_training_lowers_the_loss_and_exports(tiny_job, tmp_path):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=30, train__log_every=5,
                                          optim__lr="1e-2", eval__data_path=tiny_job / "heldout",
                                          eval__prompts_path=tiny_job / "prompts.jsonl", eval__max_new_tokens=12))
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
                                          eval__prompts_path=tiny_job / "prompts.jsonl",
                                          eval__max_new_tokens=12, eval__temperature="1.0",
                                          eval__top_k=20))
    trainer = Trainer(cfg)
    result = trainer.fit()
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert result["eval_tau"] >= 1.0 and len(result["eval_acceptance"]) == 3


def test_a_sliding_window_drafter_trains_and_exports_the_keys_the_engines_read(tiny_job, tmp_path):
    from flashdraft.config import LayerMask
    from flashdraft.drafter import DFlashDrafter

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=12, optim__lr="1e-2",
                                          drafter__layer_types="[sliding_attention]",
                                          drafter__sliding_window=6, drafter__causal="false",
                                          eval__prompts_path=tiny_job / "prompts.jsonl", eval__max_new_tokens=8))
    trainer = Trainer(cfg)
    result = trainer.fit()
    assert trainer.drafter.layer_masks == [LayerMask(6, False)] and result["eval_tau"] >= 1.0
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["layer_types"] == ["sliding_attention"] and exported["sliding_window"] == 6
    assert exported["is_causal"] is False and exported["dflash_config"]["causal"] is False
    assert DFlashDrafter.from_pretrained(tmp_path / "run" / "drafter").layer_masks == [LayerMask(6, False)]


DFLASH2 = {"drafter__family": "dflash2", "drafter__conv_group_size": 8, "drafter__selector_rank": 8,
           "drafter__selector_top_k": 8}


def test_a_dflash2_drafter_trains_its_selector_evaluates_and_exports(tiny_job, tmp_path):
    """DFlash2 end to end: the selector term ramps in, trains the codebooks, the logs carry its CE
    and the candidates' recall, the periodic greedy and sampled evals walk the selector, and the
    export loads back as a DFlash2 drafter."""
    from flashdraft.drafter import DFlashDrafter

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=16, optim__lr="1e-2",
                                          objective__selector_warmup_frac="0.25", objective__selector_ramp_frac="0.25",
                                          train__log_every=1, eval__prompts_path=tiny_job / "prompts.jsonl",
                                          eval__max_new_tokens=8, eval__temperature="1.0", **DFLASH2))
    trainer = Trainer(cfg)
    alphas = []
    trainer_step = trainer.strategy.blocks

    def record(micro, step, position):
        blocks = trainer_step(micro, step, position)
        alphas.append(blocks[0].selector.alpha)
        return blocks

    trainer.strategy.blocks = record
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
                                          drafter__attention_sink="true"))
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.drafter.layers[0].self_attn.attention_sink_bias.abs().sum() > 0  # trained from 0
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["dflash_config"]["attention_sink_bias"] is True


def test_selector_alpha_0_freezes_the_selector(tiny_job, tmp_path):
    """No gradient, no optimizer state, unchanged weights; a resume with the selector trained
    again loads the same optimizer layout (every parameter is in it)."""
    import signal

    from flashdraft.signals import Stopped

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=4, objective__selector_alpha=0,
                                          checkpoint__save_every=1, **DFLASH2))
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.drafter.candidate_selector.state_dict().items()}
    with pytest.raises(Stopped):  # preempted after step 2, its checkpoint saved: the schedule is mid-way
        trainer.fit(on_step=lambda t: t.stop.request(signal.SIGTERM) if t.step == 2 else None)
    selector = trainer.drafter.candidate_selector
    assert not any(p.requires_grad for p in selector.parameters())
    assert not any(p in trainer.optimizer.state for p in selector.parameters())
    assert all(torch.equal(before[k], v) for k, v in selector.state_dict().items())
    resumed = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=4,
                                                      checkpoint__save_every=1, **DFLASH2)))
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
                                          eval__prompts_path=job / "prompts.jsonl", eval__max_new_tokens=12))
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


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resume_after_sigkill_is_exact(tiny_job, tmp_path, references, forkserver):
    straight = references(train__max_steps=8).out
    step, reference = final_drafter(straight)
    assert step == 8

    resumed = tmp_path / "resumed"
    args = overrides(tiny_job, resumed, train__max_steps=8, checkpoint__save_every=4)
    pid, log = forkserver.spawn("cli", "train", *args, env={"FLASHDRAFT_TEST_STEP_SLEEP": "0.5"})
    latest = resumed / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and forkserver.exits.get(pid) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    forkserver.kill(pid)
    assert forkserver.wait(pid, 30) == -signal.SIGKILL
    assert latest.read_text().strip().endswith("step_00000004"), read_log(log)[-2000:]
    train(load_config(overrides=args))
    step, weights = final_drafter(resumed)
    assert step == 8
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name
    assert _losses(resumed) == _losses(straight)


def test_a_trainer_closes_its_target_on_exit_and_when_its_start_fails(tiny_job, tmp_path, monkeypatch):
    """The lifecycle in one place: ``with Trainer(...)`` releases DDP and closes the target (an
    engine target's process) on exit; a start that fails after the target loaded closes it too."""
    from flashdraft.train import startup
    from flashdraft.train.trainer import Trainer

    closed = []
    real_close = startup.close_target
    monkeypatch.setattr(startup, "close_target", lambda target: (closed.append(target), real_close(target)))
    with Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "ok", train__max_steps=1))) as trainer:
        trainer.fit()
    assert closed == [trainer.target]

    def broken(*args, **kwargs):
        raise RuntimeError("the data broke after the target loaded")

    monkeypatch.setattr(startup, "open_data", broken)
    with pytest.raises(RuntimeError, match="the data broke"):
        Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "broken")))
    assert len(closed) == 2 and closed[1] is not None and closed[1] is not trainer.target
