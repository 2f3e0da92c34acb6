"""Config mistakes are refused at start-up with the fix named; security properties of what
flashdraft reads and writes (issue 8)."""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, overrides
from flashdraft.checkpoint import MANIFEST, CheckpointError, CheckpointManager, manifest_digest, sha256_file
from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.target import TargetModel
from flashdraft.train.trainer import Trainer

PACKAGE = Path(__file__).resolve().parent.parent / "flashdraft"


# ---- config mistakes ------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "message"), [
    ({"target__layer_ids": "[1,4]"},
     r"target.layer_ids=\[1, 4\] is invalid for this 4-layer target: use distinct ids in \[0, 3\]"),
    ({"drafter__mask_token_id": 300},
     r"drafter.mask_token_id=300 is outside the target's embedding table \(vocab_size 300\): set "
     r"drafter.mask_token_id to an unused id in \[0, 299\]"),
    ({"data__token_budget": 30},
     r"data.token_budget=30 is smaller than the longest sample \(40 tokens.*raise data.token_budget to at least 40"),
    ({"drafter__family": "dflash2", "drafter__conv_group_size": 5},
     r"drafter.conv_group_size=5 must divide the target.s hidden size 32: use e.g. 16"),
    ({"drafter__family": "dflash2", "drafter__selector_top_k": 400},
     r"drafter.selector_top_k=400 exceeds the target's vocabulary \(300\)"),
], ids=["tap_beyond_layers", "mask_outside_vocab", "budget_below_longest_sample", "conv_groups", "top_k"])
def test_config_mistakes_found_with_the_target_or_data_are_refused_at_start_up(tiny_job, tmp_path, extra, message):
    extra = {k: str(v).replace("{job}", str(tiny_job)) for k, v in extra.items()}
    with pytest.raises(ValueError, match=message):
        Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run", **extra)))


@pytest.mark.parametrize(("override", "message"), [
    ("drafter.block_size=1", r"drafter.block_size=1 is invalid: use 2 or more"),
    ("drafter.mask_token_id=-1",
     r"drafter.mask_token_id=-1 is invalid: use an unused id inside the target's vocabulary"),
    ("target.layer_ids=[3,3]", r"target.layer_ids=\[3, 3\] is invalid: give distinct"),
    ("data.max_length=6", r"data.max_length=6 is invalid: every sample needs 2 \* drafter.block_size = 8"),
    ("train.collective_timeout_s=0", r"train.collective_timeout_s=0.0 is invalid: use a positive number"),
    ("train.max_nonfinite_steps=x", r"train.max_nonfinite_steps='x' is invalid: give an integer"),
    ("checkpoint.resum=never", r"unknown key checkpoint.resum; known keys of checkpoint: .*resume"),
    ("checkpoint.resume=nevr",
     r"checkpoint.resume=nevr is invalid: use auto, never, or an existing checkpoint directory"),
    ("checkpoint.save_every=-5", r"checkpoint.save_every=-5 is invalid: use 0 \(only at the end\) or more"),
    ("eval.every=-1", r"eval.every=-1 is invalid"),
])
def test_config_mistakes_are_refused_before_anything_loads(override, message):
    base = ["drafter.block_size=4"]
    with pytest.raises(ValueError, match=message):
        load_config(overrides=[*base, override])


def test_eval_data_that_no_batch_can_hold_is_refused_at_start_up_not_at_the_first_eval(tiny_job, tmp_path):
    import numpy as np

    from flashdraft.data.shards import write_token_shard

    write_token_shard(tmp_path / "long_heldout", [(np.arange(1, 200) % 290, np.ones(199))], vocab_size=300)
    with pytest.raises(ValueError, match=r"long_heldout: data.token_budget=160 is smaller than the longest sample"):
        Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run", eval__data_path=tmp_path / "long_heldout")))


def test_samples_longer_than_the_targets_positions_are_refused(tiny_job, tmp_path):
    """The start-up check itself (train.checks.check_lengths; the trainer runs it on both data
    sets: test_eval_data_that_no_batch_can_hold_is_refused_at_start_up_not_at_the_first_eval)."""
    from transformers import AutoConfig

    from flashdraft.data.dataset import open_dataset
    from flashdraft.train.checks import check_lengths

    short = AutoConfig.from_pretrained(tiny_job / "target")
    short.max_position_embeddings = 32
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run"))
    with pytest.raises(ValueError, match=r"(?s)up to 40 tokens.*max_position_embeddings=32.*"
                                         r"lower data.max_length to 32"):
        check_lengths(open_dataset(tiny_job / "data", progress=False), cfg, short)


def test_eval_prompts_outside_the_vocabulary_are_refused_at_start_up(tiny_job, tmp_path):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"input_ids": [1, 2, 999]}) + "\n")
    with pytest.raises(ValueError, match=r"(?s)prompts.jsonl: prompt 1 has token id \d+.*vocabulary \[0, 300\)"):
        Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run",
                                                eval__prompts_path=tmp_path / "prompts.jsonl")))


@pytest.mark.parametrize(("change", "message"), [
    ({"drafter__block_size": 8}, r"drafter.block_size: checkpoint 4 vs now 8"),
    ({"drafter__num_layers": 2}, r"drafter.num_layers: checkpoint 1 vs now 2"),
    ({"data__token_budget": 200}, r"data.token_budget: checkpoint 160 vs now 200"),
    # the drafter's attention layout: the same weights under other masks would train another drafter
    ({"drafter__layer_types": "[sliding_attention]", "drafter__sliding_window": 5},
     r"drafter.layer_types: checkpoint \[\] vs now \['sliding_attention'\]"),
    ({"drafter__causal": "true"}, r"drafter.causal: checkpoint None vs now True"),
])
def test_resume_with_an_incompatible_config_is_refused_with_the_fix(tiny_job, tmp_path, change, message):
    out = tmp_path / "run"
    first = Trainer(load_config(overrides=overrides(tiny_job, out)))
    first.checkpoints.save(first.step)  # step 0: what a preempted run leaves behind
    changed = Trainer(load_config(overrides=overrides(tiny_job, out, **change)))
    with pytest.raises(ValueError, match=message + r".*restore those values, or start a fresh run with another "
                                                   r"train.output_dir"):
        changed.fit()
    assert changed.step == 0


def test_a_resume_the_data_cursor_refuses_names_the_checkpoint_and_the_field(tiny_job, tmp_path):
    """The batch plan's own inputs (not RESUME keys: objective.num_anchors, data.row_budget) are
    refused by the data cursor, which named neither the section nor the checkpoint."""
    out = tmp_path / "run"
    first = Trainer(load_config(overrides=overrides(tiny_job, out)))
    first.checkpoints.save(first.step)
    changed = Trainer(load_config(overrides=overrides(tiny_job, out, objective__num_anchors=4)))
    with pytest.raises(ValueError, match=rf"cannot resume from {re.escape(str(out / 'checkpoints'))} \(step 0\): the "
                                         r"data cursor was saved with objective.num_anchors 8 but this run has 4.*"
                                         r"restore objective.num_anchors=8, or start a fresh run"):
        changed.fit()


@pytest.mark.parametrize(("given", "named"), [
    (["pipeline.placement=disaggregated", "pipeline.feature_cache_disk_bytes=1e9"],
     r"pipeline.feature_cache_disk_bytes=1000000000 is invalid: the feature cache \(both tiers\) runs in"),
    (["pipeline.placement=disaggregated", "pipeline.feature_cache_bytes=1e9"],
     r"pipeline.feature_cache_bytes=1000000000 is invalid: the feature cache \(both tiers\)"),
    (["target.tensor_parallel=2", "pipeline.feature_cache_disk_bytes=1e9"],
     r"pipeline.feature_cache_disk_bytes=1000000000 is invalid: the feature cache is not used with a tensor-parallel"),
], ids=["disk_disaggregated", "ram_disaggregated", "disk_tensor_parallel"])
def test_a_feature_cache_refusal_names_the_tier_that_is_set(given, named):
    """The disk tier under disaggregated placement was refused as pipeline.feature_cache_bytes=0."""
    with pytest.raises(ValueError, match=named):
        load_config(overrides=given)


def test_train_output_dir_is_never_another_runs_export_or_logs(tiny_job, tmp_path):
    """A run directory inside another run's export (RUN/drafter) would put checkpoints among the
    files served from there; its own directory, resumed, is fine."""
    from flashdraft.train.checks import check_paths

    run = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, run, train__max_steps=1))).fit()
    check_paths(load_config(overrides=overrides(tiny_job, run)))  # the run itself: a resume
    for inside in ("drafter", "drafter/sub", "metrics.jsonl"):
        with pytest.raises(ValueError, match=rf"train.output_dir .*{inside} is or lies inside .*, an output of the "
                                             r"training run in .*run"):
            check_paths(load_config(overrides=overrides(tiny_job, run / inside)))


def test_a_checkpoint_from_before_the_attention_layout_keys_resumes(tiny_job, tmp_path):
    """A checkpoint whose saved config predates drafter.layer_types & co. had their
    defaults then (full, bidirectional layers): it resumes under the defaults, and only them."""
    trainer = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run")))
    saved = trainer.config.to_dict()
    for key in ("layer_types", "sliding_window", "causal"):
        del saved["drafter"][key]
    trainer.checkpoints._check_compatible(saved)  # no difference
    swa = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "swa", drafter__causal="true")))
    with pytest.raises(ValueError, match=r"drafter.causal: checkpoint None vs now True"):
        swa.checkpoints._check_compatible(saved)


def test_resume_with_another_target_or_dataset_behind_the_same_paths_is_refused(tiny_job, tmp_path):
    """The config's paths are unchanged, but what they point to is not: a resume must notice."""
    out, job = tmp_path / "run", tmp_path / "job"
    shutil.copytree(tiny_job, job)
    (first := Trainer(load_config(overrides=overrides(job, out)))).checkpoints.save(first.step)
    shutil.rmtree(job / "data")
    shutil.copytree(job / "heldout", job / "data")  # other samples under data.path
    with pytest.raises(ValueError, match=r"(?s)paths changed.*data: checkpoint "
                                         r"\{'samples': 32, 'tokens': 1280\} vs now \{'samples': 8, 'tokens': 320\}"):
        Trainer(load_config(overrides=overrides(job, out))).fit()


def test_a_version_1_checkpoint_resumes_and_a_newer_format_is_refused(tiny_job, tmp_path, monkeypatch, caplog):
    """Checkpoint format 1 did not record the run's identity: such a checkpoint still resumes
    (saying that the target and data cannot be checked); a format this code does not know is
    refused with the reason."""
    import logging

    from flashdraft import checkpoint

    out = tmp_path / "run"
    first = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=3)))
    full_state = first.state.state_dict
    with monkeypatch.context() as m:  # what a version-1 run wrote: no identity in the "trainer" part
        m.setattr(checkpoint, "VERSION", 1)
        m.setattr(first.state, "state_dict", lambda: {k: v for k, v in full_state().items() if k != "identity"})
        path = first.checkpoints.save(1)
    manifest = json.loads((path / MANIFEST).read_text())
    saved_keys = [key for key, _ in json.loads((path / "trainer.json").read_text())["dict"]]
    assert manifest["version"] == 1 and "step" in saved_keys and "identity" not in saved_keys
    resumed = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=3)))
    with caplog.at_level(logging.WARNING):
        resumed.fit()
    assert "does not record the target and data it was trained on" in caplog.text
    assert "resumed from step 1" in caplog.text and resumed.step == 3

    newest = CheckpointManager(out / "checkpoints").latest_complete()
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest["version"] == checkpoint.VERSION == 3
    (newest / MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(CheckpointError, match="format version 99 unsupported"):
        CheckpointManager(out / "checkpoints").load(newest)


def test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints(tiny_job, tmp_path):
    """checkpoint.resume=never in a directory that holds checkpoints would prune them (they are newer
    than the fresh run's first save) and overwrite the export: it is refused, nothing touched."""
    out = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=4, checkpoint__save_every=2))).fit()
    before = sorted(p.name for p in (out / "checkpoints").iterdir()), (out / "config.yaml").read_text()
    fresh = Trainer(load_config(overrides=overrides(tiny_job, out, checkpoint__resume="never")))
    with pytest.raises(ValueError, match=r"checkpoint.resume=never, but .*checkpoints.* holds checkpoints of an "
                                         r"earlier run \(newest step_0+4\).*use another train.output_dir"):
        fresh.fit()
    assert (sorted(p.name for p in (out / "checkpoints").iterdir()), (out / "config.yaml").read_text()) == before


# ---- security -----------------------------------------------------------------------------


def test_no_pickle_anywhere_in_the_package():
    """No torch.load / pickle / numpy allow_pickle / eval / exec in flashdraft. (The in-memory
    object collectives between our own ranks are torch.distributed's; nothing is read from disk.)"""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                unsafe = ("pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve")
                found += [f"{path.name}: import {n}" for n in names if n.split(".")[0] in unsafe]
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id in ("eval", "exec")) \
                        or ast.unparse(f) in ("torch.load", "np.load"):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
                if any(k.arg == "allow_pickle" for k in node.keywords):
                    found.append(f"{path.name}:{node.lineno}: allow_pickle")
    assert not found, found


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_a_pickle_planted_in_a_checkpoint_is_never_unpickled_even_with_a_matching_manifest(tmp_path):
    """An attacker who can write the checkpoint dir can also fix up the manifest; loading must
    still never execute anything: parts are read with safetensors, structure with JSON."""
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(1, {"model": {"w": torch.ones(3)}})
    marker = tmp_path / "marker"
    (path / "model.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = {"size": (path / "model.safetensors").stat().st_size,
                                              "sha256": sha256_file(path / "model.safetensors")}
    manifest["digest"] = manifest_digest(manifest)  # the attacker fixes the digest up too
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot load"):
        manager.load(path)
    assert not marker.exists()


def test_trainer_checkpoints_and_exports_are_safetensors_and_json_only(tiny_job, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=1)))
    trainer.fit()
    files = [p for p in out.rglob("*") if p.is_file()]
    checkpoint_files = [p for p in files if "checkpoints" in p.parts and p.name != "latest"]
    export_files = [p for p in files if "drafter" in p.parts]
    assert checkpoint_files and export_files
    assert {p.suffix for p in checkpoint_files + export_files} == {".safetensors", ".json"}


def test_remote_code_in_a_target_directory_is_not_run_unless_asked(tmp_path):
    target = tmp_path / "evil_target"
    target.mkdir()
    marker = tmp_path / "remote_code_ran"
    (target / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilForCausalLM"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}}))
    (target / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert load_config().target.trust_remote_code is False
    with pytest.raises(ValueError, match="trust_remote_code"):
        TargetModel.from_pretrained(target)
    assert not marker.exists()



@pytest.mark.slow
def test_the_command_line_prints_a_mistake_as_one_line_with_the_fix(monkeypatch):
    """A user's mistake is a message naming the fix, not a 20-line traceback (exit status 2);
    FLASHDRAFT_TRACEBACK=1 lets the error through (the interpreter prints its traceback: checked
    in this process, sparing a second ~6 s interpreter start)."""
    from flashdraft.cli import entry

    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("FLASHDRAFT_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-m", "flashdraft.cli", "train", "drafter.block_size=1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("flashdraft train: error: config drafter.block_size=1 is invalid: use 2 or more")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("FLASHDRAFT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="drafter.block_size=1 is invalid"):
        entry(["train", "drafter.block_size=1"])


def test_a_second_run_on_the_same_output_dir_is_refused_while_the_first_trains(tiny_job, tmp_path):
    """Two runs in one train.output_dir would re-save each other's steps and interleave metrics.jsonl."""
    from flashdraft.train.runtime import output_lock

    out = tmp_path / "run"
    with output_lock(out):  # the first run, training
        with pytest.raises(ValueError, match=rf"(?s)another flashdraft run \(pid {os.getpid()} on .*\).*"
                                             r"train.output_dir.*wait for it to end, or use another directory"):
            Trainer(load_config(overrides=overrides(tiny_job, out))).fit()
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=2))).fit()  # free again once it ends


def test_data_prepared_with_another_tokenizer_is_refused_at_start_up(tmp_path, caplog):
    """Ids from another tokenizer fit the vocabulary and would train silently on the wrong tokens."""
    import logging

    from flashdraft.data.dataset import open_dataset
    from flashdraft.data.prepare import prepare
    from flashdraft.toy import synthetic_conversations, tiny_causal_lm, train_toy_tokenizer
    from flashdraft.train.checks import check_tokenizer, target_tokenizer

    records = synthetic_conversations(40, seed=2)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [m["content"] for r in records for m in r["messages"]]
    tok_target, tok_other = train_toy_tokenizer(texts, 400), train_toy_tokenizer(texts[::3], 400)
    assert len(tok_target) == len(tok_other) and tok_target.get_vocab() != tok_other.get_vocab()
    tiny_causal_lm(tok_target, num_layers=2, hidden=32).save_pretrained(tmp_path / "target")
    tok_target.save_pretrained(tmp_path / "target")
    tok_other.save_pretrained(tmp_path / "other-tok")
    for name, tok_dir in (("ok", tmp_path / "target"), ("other", tmp_path / "other-tok")):
        prepare([tmp_path / "chats.jsonl"], tok_dir, tmp_path / name, max_length=256, min_supervised=8,
                num_workers=1, progress=False, log=lambda *_: None)

    def trainer(data, *extra):
        return Trainer(load_config(overrides=[
            f"target.path={tmp_path / 'target'}", f"data.path={tmp_path / data}", "drafter.num_layers=1",
            "drafter.block_size=4", "target.layer_ids=[0,1]", "data.token_budget=512", "train.device=cpu",
            f"train.output_dir={tmp_path / 'run'}", *extra]))

    check_tokenizer(tmp_path / "target", open_dataset(tmp_path / "ok", progress=False))  # the target's own: accepted
    with pytest.raises(ValueError, match=r"(?s)other: prepared with the tokenizer of .*other-tok.*"
                                         r"Re-run flashdraft prepare with --tokenizer"):
        trainer("other")  # the trainer runs the check at start-up
    # A target directory without tokenizer files cannot be compared: a warning, not a false mismatch
    # (transformers would "load" a 1-token tokenizer from it).
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "target" / name).unlink(missing_ok=True)
    target_tokenizer.cache_clear()  # loaded once per process: this one saw the files before they went
    with caplog.at_level(logging.WARNING):
        check_tokenizer(tmp_path / "target", open_dataset(tmp_path / "other", progress=False))
    assert "cannot check that" in caplog.text and "no tokenizer files" in caplog.text


@pytest.mark.parametrize("overrides_,field", [
    (["drafter.layer_types=[sliding_attention]"], "drafter.sliding_window"),  # no window
    (["drafter.layer_types=[sliding_attention]", "drafter.sliding_window=0"],
     "drafter.sliding_window"),
    (["drafter.sliding_window=64"], "drafter.sliding_window"),  # a window without a sliding layer
    (["drafter.layer_types=[sliding_attention, full_attention]"], "drafter.layer_types"),  # 5 layers
    (["drafter.layer_types=[chunked_attention]"], "drafter.layer_types"),
    (["objective.weighting=kl"], "objective.weighting"),
    (["objective.loss=kl"], "objective.loss"),
    (["objective.lk_kl_scale=-1"], "objective.lk_kl_scale / lk_kl_decay"),
    (["eval.top_k=20"], "eval.top_p / top_k"),  # top-k without a temperature
    (["objective.selector_alpha=0.5"], "objective.selector_alpha"),  # a DFlash2 knob on a DFlash drafter
    (["drafter.selector_rank=64", "drafter.conv_group_size=8"], "drafter.conv_group_size=8, drafter.selector_rank"),
    (["drafter.family=dflash2", "objective.selector_warmup_frac=0.7", "objective.selector_ramp_frac=0.5"],
     "objective.selector_warmup_frac / selector_ramp_frac"),  # alpha never reached
    (["drafter.family=dflash2", "drafter.conv_kernel_size=17"], "drafter.conv_kernel_size"),  # more taps than slots
    (["target.tensor_parallel=0"], "target.tensor_parallel"),
    (["target.expert_parallel=true"], "target.expert_parallel"),  # without tensor_parallel
    (["target.tensor_parallel=2", "pipeline.feature_cache_bytes=1000"], "pipeline.feature_cache_bytes"),
    (["target.tensor_parallel=2", "pipeline.placement=disaggregated", "eval.prompts_path=p.jsonl"],
     "eval.data_path / eval.prompts_path"),  # the evals would need the whole target on a drafter rank
])
def test_drafter_layout_and_sampling_mistakes_are_refused_at_load_naming_the_field(overrides_, field):
    with pytest.raises(ValueError, match=f"config {re.escape(field)}="):
        load_config(overrides=overrides_)


@pytest.mark.parametrize("override,field", [
    ("objective.gamma=.inf", "objective.gamma"), ("optim.lr=inf", "optim.lr"), ("optim.lr=.nan", "optim.lr"),
    ("train.collective_timeout_s=.inf", "train.collective_timeout_s"), ("optim.init_std=.nan", "optim.init_std"),
    ("optim.init_std=-0.02", "optim.init_std"), ("optim.betas=[0.9, 1.5]", "optim.betas"),
    ("optim.betas=[.nan, 0.9]", "optim.betas"), ("optim.weight_decay=.nan", "optim.weight_decay"),
    ("optim.weight_decay=-1", "optim.weight_decay"), ("pipeline.join_timeout_s=.inf", "pipeline.join_timeout_s"),
    ("objective.dpace_alpha=0", "objective.dpace_alpha"), ("objective.dpace_alpha=1.5", "objective.dpace_alpha"),
    ("eval.temperature=-1", "eval.temperature"), ("eval.top_p=0", "eval.top_p"),
])
def test_non_finite_or_out_of_range_floats_are_refused_at_load_naming_the_field(override, field):
    with pytest.raises(ValueError, match=rf"config {re.escape(field)}=.+ is invalid"):
        load_config(overrides=[override])


@pytest.mark.parametrize("override", [
    "objective.num_anchors=1" + "0" * 30, "train.seed=18446744073709551616", "data.max_batch_size=1e30",
    "train.collective_timeout_s=1e308", "train.startup_timeout_s=1e12", "pipeline.join_timeout_s=1e308"])
def test_integers_and_timeouts_beyond_what_their_consumers_hold_are_refused_at_load(override):
    """A 31-digit num_anchors (OverflowError in the batch plan), a seed of 2**64 ("Overflow when
    unpacking long long"), a timeout of 1e308 (timedelta / time_t overflow at start-up) passed
    validation and then raised."""
    field = override.split("=")[0]
    with pytest.raises(ValueError, match=rf"config {re.escape(field)}=.* is invalid: (give an integer below "
                                         r"2\*\*63|use a positive number of seconds up to 1e\+09)"):
        load_config(overrides=[override])


def test_exports_and_checkpoints_follow_the_umask(tiny_job, tmp_path):
    """safetensors creates its files 0600: a serving process of another user could not read the export."""
    out = tmp_path / "run"
    previous = os.umask(0o027)
    try:
        trainer = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=1)))
        path = trainer.checkpoints.save(0)
        trainer.drafter.save_pretrained(tmp_path / "export")
    finally:
        os.umask(previous)
    files = [*path.rglob("*.safetensors"), tmp_path / "export" / "model.safetensors"]
    assert len(files) >= 4 and {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o640)}
    assert (tmp_path / "export" / "config.json").stat().st_mode & 0o777 == 0o640


def test_a_run_whose_checkpoints_are_all_damaged_stops_and_deletes_nothing(tiny_job, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=6, checkpoint__save_every=2))).fit()
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004", "step_00000006"]
    for ckpt in ckpts:  # one flipped byte in each checkpoint's drafter weights
        weights = ckpt / "drafter.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x01
        weights.write_bytes(bytes(data))
    again = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=8, checkpoint__save_every=2)))
    with pytest.raises(CheckpointError, match=r"holds 3 checkpoints \(newest step_00000006\) but none of them loads.*"
                                              r"Nothing was deleted"):
        again.fit()
    assert sorted((out / "checkpoints").glob("step_*")) == ckpts


def test_a_resume_that_changes_what_a_step_holds_under_max_steps_says_so(tiny_job, tmp_path, caplog):
    # train.max_steps counts steps: with grad_accum 1 -> 2 the steps left train twice the samples.
    import signal

    from flashdraft.signals import Stopped

    out = tmp_path / "run"
    first = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=4, checkpoint__save_every=2)))
    with pytest.raises(Stopped):  # preempted after step 2, as SIGTERM would (its checkpoint saved)
        first.fit(on_step=lambda t: t.stop.request(signal.SIGTERM) if t.step == 2 else None)
    resumed = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=4, checkpoint__save_every=2,
                                                      train__grad_accum=2)))
    resumed.fit()
    assert resumed.step == 4
    assert re.search(r"train.max_steps=4 counts optimizer steps: each step now takes 2 batches \(world size 1 x "
                     r"grad_accum 2\) where the checkpoint's took 1 \(1 x 1\), so the steps left train 2.00x",
                     caplog.text)


@pytest.mark.parametrize(("first", "more", "budget"), [
    ({"train__max_steps": 4}, {"train__max_steps": 6}, "train.max_steps=6"),
    ({"train__max_steps": "null", "train__epochs": 1}, {"train__max_steps": "null", "train__epochs": 2},
     "train.epochs=2"),
], ids=["max_steps", "epochs"])
def test_raising_the_budget_of_a_finished_run_is_refused_not_trained_at_learning_rate_0(tiny_job, tmp_path, first,
                                                                                        more, budget):
    """A finished run's warmup-cosine schedule is at its end (LR 0): the added steps used to train
    at LR 0, exit 0 and read as success, the final weights those of the finished run."""
    out = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, out, **first))).fit()
    saved = {p: p.read_bytes() for p in sorted((out / "checkpoints").rglob("*")) if p.is_file()}
    again = Trainer(load_config(overrides=overrides(tiny_job, out, **more)))
    with pytest.raises(ValueError, match=rf"cannot train \d+ more steps in .*run: its run ended its learning-rate "
                                         rf"schedule at step \d+ .*with {budget} every added step would train at "
                                         r"learning rate 0.*another train.output_dir"):
        again.fit()
    assert {p: p.read_bytes() for p in sorted((out / "checkpoints").rglob("*")) if p.is_file()} == saved


def test_a_checkpoint_whose_manifest_leaves_out_a_part_is_refused_by_name(tiny_job, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=2, checkpoint__save_every=2))).fit()
    path = out / "checkpoints" / "step_00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["parts"].remove("optimizer")  # an edit that keeps the manifest self-consistent
    manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    again = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=4, checkpoint__save_every=2)))
    with pytest.raises(CheckpointError, match=r"step 2 checkpoint holds no optimizer state"):
        again.fit()


def test_a_damaged_newest_checkpoint_is_skipped_and_kept_not_deleted(tiny_job, tmp_path):
    """Resuming from the last good checkpoint, the save of the damaged one's step used to delete it:
    it is kept, out of the way of the next resume."""
    out = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=6, checkpoint__save_every=2))).fit()
    weights = out / "checkpoints" / "step_00000006" / "drafter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    damaged = weights.read_bytes()
    resumed = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=10, checkpoint__save_every=2)))
    resumed.fit()  # resumes from step 4, saves step 6 again (where the damaged one is), 8, 10
    assert resumed.step == 10
    kept = out / "checkpoints" / "abandoned-step_00000006" / "drafter.safetensors"
    assert kept.read_bytes() == damaged
    assert CheckpointManager(out / "checkpoints").load_latest().step == 10


def test_steps_trained_again_after_a_resume_appear_once_in_metrics_jsonl(tiny_job, tmp_path):
    out = tmp_path / "run"
    Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=6, checkpoint__save_every=2))).fit()
    (out / "metrics.jsonl").open("a").write('{"step": 7, "loss": 1.0')  # and a line torn by a crash
    resumed = Trainer(load_config(overrides=overrides(
        tiny_job, out, train__max_steps=6, checkpoint__save_every=2,
        checkpoint__resume=out / "checkpoints" / "step_00000004")))
    resumed.fit()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [s for s, line in zip(steps, (out / "metrics.jsonl").read_text().splitlines()) if '"loss"' in line]
    assert losses == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 once, from the resumed run
    abandoned = (out / "metrics.abandoned.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in abandoned[:-1]] == [5, 6] and abandoned[-1].startswith('{"step": 7')


def test_a_block_longer_than_a_sample_and_an_eval_prompt_beyond_the_targets_positions_are_refused(tiny_job, tmp_path):
    with pytest.raises(ValueError, match=r"(?s)drafter.block_size=64 is invalid.*longer than a sample.*"
                                         r"data.max_length=32"):
        load_config(overrides=["drafter.block_size=64", "data.max_length=32", "data.min_supervised=1"])
    (tmp_path / "long.jsonl").write_text(json.dumps({"input_ids": [1] * 500}) + "\n")
    from transformers import AutoConfig

    from flashdraft.train.checks import load_eval_prompts

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", eval__prompts_path=tmp_path / "long.jsonl",
                                          eval__max_new_tokens=64))
    with pytest.raises(ValueError, match=r"(?s)long.jsonl: prompt 1 has 500 tokens.*64 new tokens.*block of 4.*568 "
                                         r"positions.*max_position_embeddings=512"):
        load_eval_prompts(cfg, None, AutoConfig.from_pretrained(tiny_job / "target"))  # the trainer's start-up check


def test_a_full_disk_under_metrics_jsonl_costs_log_lines_not_the_run(tiny_job, tmp_path, caplog):
    import logging

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC, as on a full disk
    trainer = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=4, checkpoint__save_every=2)))
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.step == 4 and CheckpointManager(out / "checkpoints").load_latest().step == 4
    assert caplog.text.count("metrics: cannot write step") == 1  # warned once, not once per line


def test_an_output_dir_or_checkpoints_path_that_is_a_file_is_refused_at_start(tiny_job, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"train.output_dir .*afile: cannot use it for the run's outputs"):
        Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "afile"))).fit()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    trainer = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run")))
    with pytest.raises(ValueError, match=r"checkpoints is a file"):
        trainer.fit()
    assert trainer.step == 0  # refused before training, not at the first save


# ---- issue 31, 8, 16: knobs of an option that is not selected are refused, naming their values ----

@pytest.mark.parametrize("given, refused, fix", [
    (["objective.dpace_alpha=0.7"], "objective.dpace_alpha=0.7 is", "set objective.weighting=dpace too"),
    (["objective.weighting=dpace", "objective.gamma=7"], "objective.gamma=7.0 is", "set objective.weighting=decay"),
    (["objective.weighting=dpace", "objective.gamma=null"], "objective.gamma=null is", "weighting=decay"),
    (["objective.lk_kl_scale=2"], "objective.lk_kl_scale=2.0 is", "set objective.loss=lk_lambda too"),
    (["objective.loss=tv", "objective.lk_kl_decay=0.5"], "objective.lk_kl_decay=0.5 is", "loss=lk_lambda"),
    (["drafter.family=dflash2", "objective.selector_alpha=0", "objective.selector_warmup_frac=0.2",
      "objective.selector_ramp_frac=0.1"], "objective.selector_warmup_frac=0.2, objective.selector_ramp_frac=0.1 are",
     "set objective.selector_alpha above 0 too"),
    (["drafter.selector_rank=64"], "drafter.selector_rank=64 is", "set drafter.family=dflash2 too"),  # no "=set"
])
def test_knobs_of_an_unselected_option_are_refused_at_load(given, refused, fix):
    from flashdraft.config import load_config

    with pytest.raises(ValueError, match=rf"config {re.escape(refused)} ignored: .*{re.escape(fix)}"):
        load_config(overrides=given)


def test_the_selected_options_knobs_and_a_saved_config_load():
    from flashdraft.config import load_config, to_yaml

    for given in (["objective.weighting=dpace", "objective.dpace_alpha=0.7"], ["objective.gamma=5"],
                  ["objective.loss=lk_lambda", "objective.lk_kl_scale=2"], ["drafter.family=dflash2",
                   "objective.selector_warmup_frac=0.2"]):
        config = load_config(overrides=given)
        assert load_config(base=__import__("yaml").safe_load(to_yaml(config))) == config


# ---- issue 31, 10: one-line errors where tracebacks were -----------------------------------------

def test_a_yaml_alias_bomb_or_deep_nesting_in_a_config_is_one_short_line(tmp_path):
    layers = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for name, prev in zip("bcdefghi", "abcdefgh"):  # 9^9 strings if expanded
        layers.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    (tmp_path / "bomb.yaml").write_text("target:\n  path: [" + ", ".join(layers) + "]\n")
    (tmp_path / "deep.yaml").write_text("target:\n  layer_ids: " + "[" * 5000 + "]" * 5000 + "\n")
    deep = "[" * 5000 + "]" * 5000
    for args, wanted in [(["--config", str(tmp_path / "bomb.yaml")], "config target.path=[['lol'"),
                         (["--config", str(tmp_path / "deep.yaml")], f"{tmp_path / 'deep.yaml'}: nested too deeply"),
                         ([f"target.layer_ids={deep}"], "config target.layer_ids='[[[[")]:
        with pytest.raises(ValueError) as exc:  # the command line prints it as one `error:` line
            main(["config", *args])
        assert str(exc.value).startswith(wanted) and len(str(exc.value)) < 300 and "\n" not in str(exc.value)


def test_a_selector_too_large_for_the_device_is_refused_at_start_up_with_its_size(tiny_job, tmp_path):
    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.train.checks import check_drafter_sizes

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", drafter__family="dflash2",
                                          drafter__conv_group_size=8, drafter__selector_rank=1_000_000_000))
    with pytest.raises(ValueError, match=r"(?s)drafter.selector_rank=1000000000:.*10,112.0 GB.*GB of this device.*"
                                         r"use e.g. 256"):
        check_drafter_sizes(cfg, "cpu")


# ---- issue 31, 16: messages name the flag, the file and the list's kind --------------------------

def test_a_list_of_strings_is_asked_for_as_names_not_numbers():
    from flashdraft.config import load_config

    with pytest.raises(ValueError, match=r"config train.metrics=3 is invalid: give a list of names, e.g. \[a, b\]"):
        load_config(overrides=["train.metrics=3"])
    with pytest.raises(ValueError, match=r"config target.layer_ids='x' is invalid: give a list, e.g. \[1, 2\]"):
        load_config(overrides=["target.layer_ids=x"])


# ---- issue 31, 14: accepted silently before, refused now -----------------------------------------

def test_a_duplicate_yaml_key_a_two_conversation_record_and_boolean_token_ids_are_refused(tmp_path, eval_dir):
    from flashdraft.config import load_config
    from flashdraft.data.chat import SampleError, normalize_record

    (tmp_path / "dup.yaml").write_text("optim:\n  lr: 6e-4\n  lr: 1e-3\n")
    with pytest.raises(ValueError, match=r"dup.yaml: not valid YAML at line 3, column 3 \(key 'lr' given twice"):
        load_config(tmp_path / "dup.yaml")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(SampleError, match=r"r: both 'messages' and 'conversations'; keep one") as exc:
        normalize_record({"messages": turns, "conversations": [{"from": "human", "value": "other"}]}, "r")
    assert exc.value.reason == "bad_shape"
    (tmp_path / "bools.jsonl").write_text('{"input_ids": [true, false, true]}\n')
    with pytest.raises(ValueError, match=r"bools.jsonl:1: input_ids must be a non-empty list of token ids"):
        main(["eval", "--target", str(eval_dir / "target"), "--baseline", "ngram", "--prompts",
              str(tmp_path / "bools.jsonl"), "--device", "cpu"])


def test_a_mask_token_id_that_occurs_in_the_training_data_is_warned_at_start_up(tiny_job, tmp_path, caplog):
    import logging

    import numpy as np

    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.data.dataset import open_dataset
    from flashdraft.train.checks import check_mask_token
    from flashdraft.train.trainer import Trainer

    data = open_dataset(tiny_job / "data")
    used = int(data[3][0][0])  # the first token of sample 3
    unused = int(np.setdiff1d(np.arange(300), np.asarray(data.ids))[0])
    assert check_mask_token(data, unused) == 0
    assert check_mask_token(data, used, chunk=7) == int((data.ids == used).sum()) > 0  # chunked == whole
    with caplog.at_level(logging.WARNING):
        Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run", drafter__mask_token_id=used)))
    assert f"drafter.mask_token_id={used} occurs" in caplog.text and "set drafter.mask_token_id to an id" in caplog.text


# ---- issue 31, the trial's re-run (h31b): defects its probes found -------------------------------

def test_train_output_dir_is_never_the_target_or_the_runs_data(tiny_job, tmp_path):
    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.train.checks import check_paths

    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run"))
    check_paths(cfg)  # a run directory of its own
    for out, field in [(cfg.target.path, "target.path"), (f"{cfg.target.path}/run", "target.path"),
                       (cfg.data.path, "data.path")]:
        bad = load_config(overrides=overrides(tiny_job, out))
        with pytest.raises(ValueError, match=rf"train.output_dir .* is or lies inside {field} .*another directory"):
            check_paths(bad)


@pytest.mark.parametrize(("override", "field"), [("data.min_supervised=-2", "data.min_supervised=-2"),
                                                 ("train.seed=-1", "train.seed=-1"),
                                                 ("train.output_dir=", "train.output_dir=''")])
def test_a_negative_seed_or_minimum_or_an_empty_run_directory_is_refused_at_load(override, field):
    from flashdraft.config import load_config

    with pytest.raises(ValueError, match=rf"config {re.escape(field)} is invalid: (use|give)"):
        load_config(overrides=[override])
