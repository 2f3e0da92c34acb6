"""The quickstart end to end at seconds-level budgets, and `flashdraft eval` on its outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.evaluate import read_prompts, write_prompts
from flashdraft.quickstart import SMOKE, SMOKE_TRAINING, quickstart

# end to end: the whole smoke quickstart, run once (the module fixture) on one pytest-xdist worker
# (each test marked slow and grouped); issue 31's refusals below run no stage: the fast loop's


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("quickstart")
    return out, quickstart(out, SMOKE, SMOKE_TRAINING, use_cache=False)


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_smoke_quickstart_leaves_the_documented_layout(smoke_run):
    out, report = smoke_run
    for path in ("target/config.json", "target/tokenizer.json", "drafter/config.json", "drafter/model.safetensors",
                 "eval/prompts.jsonl", "eval/report.json", "training.png", "summary.md", "run/metrics.jsonl"):
        assert (out / path).is_file(), path
    saved = json.loads((out / "eval" / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for key in ("tau", "tau_untrained", "tau_ngram", "per_position_acceptance", "lossless", "settings"):
        assert key in saved, key
    assert saved["lossless"] is True
    assert 1.0 <= saved["tau"] <= SMOKE_TRAINING["drafter.block_size"]
    assert len(saved["per_position_acceptance"]) == SMOKE_TRAINING["drafter.block_size"] - 1
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_the_quickstarts_files_follow_the_umask(smoke_run):
    """Its target's weights were 0600 (safetensors' writer), unlike its checkpoints and exports:
    a serving process of another user could not read them."""
    from flashdraft.checkpoint import _umask

    out, _ = smoke_run
    wanted = 0o666 & ~_umask()
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*")
             if p.is_file() and p.suffix in (".safetensors", ".json", ".md")}
    assert "target/model.safetensors" in modes and "eval/report.json" in modes
    assert {path: mode for path, mode in modes.items() if mode != wanted} == {}


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_quickstart_reuses_target_features_from_the_second_epoch(smoke_run):
    """Its drafter sees every sample more than once: the feature cache holds them all and serves
    the later epochs (the summary says so)."""
    out, report = smoke_run
    cache = report["feature_cache"]
    assert cache["misses"] == cache["entries"] > 0  # every sample computed once, and kept
    assert cache["hits"] > 0 and cache["skipped_forwards"] > 0
    assert "feature cache:" in (out / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_flashdraft_eval_reproduces_the_report_on_the_output_triple(smoke_run, tmp_path):
    out, report = smoke_run
    code = main(["eval", "--target", str(out / "target"), "--drafter", str(out / "drafter"),
                 "--prompts", str(out / "eval" / "prompts.jsonl"),
                 "--max-new-tokens", str(SMOKE.eval_max_new_tokens), "--output", str(tmp_path / "r.json")])
    again = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and again["lossless"] is True
    assert again["tau"] == report["tau"]
    assert again["per_position_acceptance"] == report["per_position_acceptance"]


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_periodic_eval_tau_matches_flashdraft_eval_on_the_export(smoke_run, tmp_path):
    """The trainer's last eval (every held-out prompt, 32 new tokens) measured the weights it exported."""
    out, _ = smoke_run
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in records if "eval_tau" in r][-1]
    write_prompts(tmp_path / "p.jsonl", read_prompts(out / "eval" / "prompts.jsonl")[:SMOKE.num_eval_prompts])
    main(["eval", "--target", str(out / "target"), "--drafter", str(out / "drafter"), "--prompts",
          str(tmp_path / "p.jsonl"), "--max-new-tokens", "32", "--output", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["tau"] == last_eval["eval_tau"]


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_help_shows_the_choices_of_drafter_and_weighting(capsys):
    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--drafter {dflash,dflash2}" in text and "--weighting {decay,dpace}" in text
    with pytest.raises(SystemExit):  # a wrong choice is refused by the parser, naming the choices
        main(["quickstart", "--weighting", "foo"])
    assert "--weighting: invalid choice: 'foo'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
@pytest.mark.parametrize("flags,message", [(["--sliding-window", "-5"], "--sliding-window -5: use 0")])
def test_bad_variant_flags_are_refused_before_any_stage_runs(tmp_path, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["quickstart", "--smoke", "--output", str(tmp_path / "qs"), *flags])
    assert not (tmp_path / "qs").exists()  # nothing written, no target trained


# ---- issue 31, 13: quickstart budget mistakes are refused before any stage runs ------------------

@pytest.mark.parametrize("flags, wanted", [
    (["--drafter-lr", "-1.0"], "optim.lr=-1.0"), (["--num-anchors", "0"], "objective.num_anchors=0"),
    (["--block-size", "1"], "drafter.block_size=1"), (["--regen-temperature", "-1.0"], "--regen-temperature -1.0"),
    (["--regen-temperature", "1e-40"], "--regen-temperature 1e-40"),
    (["--target-layers", "0"], "--target-layers 0: use 1 or more"),  # the trial's re-run: a late, wrong fix before
    (["--target-hidden", "3"], "--target-hidden 3: use a positive multiple of 8"),  # a ZeroDivisionError traceback
    (["--sliding-window", "1"], "drafter.sliding_window=1 is invalid"),  # no slot would see a target feature
    (["--answer-tokens", "0"], "--answer-tokens 0: use 1 or more"),  # "need at least one array to concatenate"
    (["--num-eval-prompts", "0"], "--num-eval-prompts 0: use 1 or more"),  # a ZeroDivisionError traceback
    (["--corpus-bytes", "-5"], "--corpus-bytes -5: use 1 or more"),  # "found no Python standard library sources"
    (["--target-steps", "-1"], "--target-steps -1: use 0 or more"),  # an untrained target, silently
    (["--vocab-size", "1"], "--vocab-size 1: a byte-level BPE holds the 256 byte tokens"),  # ignored silently
])
def test_quickstart_budget_mistakes_are_refused_before_any_stage(tmp_path, flags, wanted):
    with pytest.raises(ValueError, match=re.escape(wanted)):
        main(["quickstart", "--smoke", "--output", str(tmp_path / "qs"), *flags])
    assert not (tmp_path / "qs").exists()  # no stage ran


# ---- issue 31, the trial's re-run (h31b): defects its probes found -------------------------------

def test_quickstart_never_writes_into_a_directory_of_other_content(tmp_path):
    """The trial's re-run: --output onto a model directory wrote all seven stages among its files."""
    from flashdraft.quickstart import SMOKE, quickstart

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"(?s)--output {re.escape(str(model))} holds what no quickstart writes "
                                         r"\(config.json\).*give a new or empty directory"):
        quickstart(model, SMOKE)
    assert [p.name for p in model.iterdir()] == ["config.json"]


def test_the_vllm_target_backend_runs_without_in_training_evals(tmp_path, capsys):
    """--target-backend vllm: the engine computes the features; the in-training tau (which decodes
    in-process) is off, the final eval (stage 6) still judges the export with the target in-process."""
    from flashdraft.quickstart import TRAINING, _drafter_config

    config = _drafter_config(tmp_path / "qs", SMOKE, {**TRAINING, "target.backend": "vllm"}, 0)
    assert config.target.backend == "vllm" and config.eval.num_prompts == 0
    assert config.eval.prompts_path  # the final eval's prompts: written and used by stage 6
    assert _drafter_config(tmp_path / "qs", SMOKE, TRAINING, 0).eval.num_prompts == SMOKE.num_eval_prompts
    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    assert "--target-backend {transformers,vllm}" in " ".join(capsys.readouterr().out.split())
