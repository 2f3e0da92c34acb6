"""Starting from a released drafter (drafter.init_from): a flashdraft export and a checkpoint written
by the DFlash authors' package load, the drafter's shape comes from them, a mismatch is refused by
name, the step-0 eval is the released drafter's own tau, and a resume of such a run is exact."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from conftest import make_job, overrides, tiny_qwen3
from flashdraft.checkpoint import CheckpointManager
from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.drafter import serving
from flashdraft.train.trainer import Trainer


@pytest.fixture(scope="module")
def released(tiny_job, tmp_path_factory):
    """A drafter trained for 20 steps on the tiny job and exported: the one runs start from."""
    out = tmp_path_factory.mktemp("released")
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=20, optim__lr="1e-2"))).fit()
    return out / "drafter"


def _eval(tiny_job) -> dict:
    """The in-training eval: the job's first 3 prompts, 10 new tokens each."""
    return {"eval__prompts_path": tiny_job / "prompts.jsonl", "eval__num_prompts": 3,
            "eval__max_new_tokens": 10}


def test_a_run_starts_from_the_export_and_its_step_0_eval_is_flashdraft_evals_tau(tiny_job, released, tmp_path):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=2, drafter__init_from=released,
                                          **_eval(tiny_job)))
    trainer = Trainer(cfg)
    weights = serving.read_weights(released)
    assert all(torch.equal(trainer.drafter.state_dict()[k], v.float()) for k, v in weights.items())
    trainer.fit()
    step0 = next(h for h in trainer.history if h["step"] == 0 and "eval_tau" in h)
    prompts, report = tmp_path / "prompts.jsonl", tmp_path / "report.json"
    prompts.write_text("\n".join((tiny_job / "prompts.jsonl").read_text().splitlines()[:3]) + "\n")
    assert main(["eval", "--target", str(tiny_job / "target"), "--drafter", str(released), "--prompts", str(prompts),
                 "--max-new-tokens", "10", "--device", "cpu", "--output", str(report)]) == 0
    found = json.loads(report.read_text())
    assert step0["eval_tau"] == pytest.approx(found["tau"], abs=1e-12)
    assert step0["eval_tau_pooled"] == pytest.approx(found["tau_pooled"], abs=1e-12)


def test_the_drafters_shape_comes_from_the_export_and_a_disagreeing_key_is_refused(tiny_job, released, tmp_path):
    base = overrides(tiny_job, tmp_path / "run", drafter__init_from=released)
    shaped = [o for o in base if not o.startswith(("drafter.num_layers", "drafter.block_size",
                                                   "target.layer_ids", "drafter.mask_token_id"))]
    trainer = Trainer(load_config(overrides=shaped))  # the defaults (5 layers, block 16) give way to the export's
    assert (trainer.config.drafter.num_layers, trainer.config.drafter.block_size) == (1, 4)
    assert trainer.config.target.layer_ids == (1, 2) and trainer.config.drafter.mask_token_id == 299
    with pytest.raises(ValueError, match=r"drafter.num_layers=2 disagrees with the drafter in drafter.init_from="
                                         r".*\(1\): drop drafter.num_layers"):
        Trainer(load_config(overrides=base + ["drafter.num_layers=2"]))


def test_an_export_for_another_target_is_refused_before_any_weights_load(released, tmp_path_factory, tmp_path):
    other = make_job(tmp_path_factory.mktemp("other"), tiny_qwen3(num_layers=4, hidden=48, seed=2))
    with pytest.raises(ValueError, match=r"was trained for another target than target.path=.*hidden_size 32 vs 48"):
        Trainer(load_config(overrides=overrides(other, tmp_path / "run", drafter__init_from=released)))


def test_a_resume_of_an_init_from_run_is_exact(tiny_job, released, tmp_path):
    knobs = {"drafter__init_from": released, "train__max_steps": 4, "checkpoint__save_every": 2}
    straight = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "straight", **knobs)))
    straight.fit()
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    manager = CheckpointManager(tmp_path / "resumed" / "checkpoints")
    shutil.rmtree(manager.root / "step_00000004")
    (manager.root / "latest").write_text("step_00000002")
    resumed = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "resumed", **knobs)))
    resumed.fit()
    losses = [h["loss"] for h in resumed.history if "loss" in h]
    assert losses == [h["loss"] for h in straight.history if "loss" in h][2:]
    for name, value in straight.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[name], value), name


@pytest.mark.slow
def test_a_checkpoint_in_the_dflash_authors_format_loads_and_fine_tunes(tiny_job, released, tmp_path):
    """The DFlash authors' package (dflash 0.1.0, in the engine environment) builds its own drafter
    from the export's config and saves it with save_pretrained (its key names, its config.json):
    flashdraft starts from it with exactly its weights."""
    from flashdraft.judge.reference import reference_python
    from flashdraft.vllm_env import EngineUnavailable

    try:
        python = reference_python(log=lambda m: None)
    except EngineUnavailable as exc:
        pytest.skip(f"the DFlash reference package cannot be had here: {exc}")
    zlab = tmp_path / "zlab"
    script = (
        "import json, sys, torch\n"
        "from transformers import Qwen3Config\n"
        "from dflash.model import DFlashDraftModel\n"
        "config = Qwen3Config(**json.load(open(sys.argv[1] + '/config.json')))\n"
        "torch.manual_seed(0)\n"
        "DFlashDraftModel(config).save_pretrained(sys.argv[2])\n"
    )
    subprocess.run([str(python), "-c", script, str(released), str(zlab)], check=True, capture_output=True,
                   env={"PYTHONPATH": "", "PATH": "/usr/bin:/bin"})
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", train__max_steps=2, drafter__init_from=zlab,
                                          **_eval(tiny_job)))
    trainer = Trainer(cfg)
    theirs = serving.read_weights(zlab)
    assert set(theirs) == set(trainer.drafter.state_dict())
    assert all(torch.equal(trainer.drafter.state_dict()[k], v.float()) for k, v in theirs.items())
    trainer.fit()
    assert any(h["step"] == 0 and "eval_tau" in h for h in trainer.history)
