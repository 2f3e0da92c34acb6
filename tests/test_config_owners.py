"""The config's sections are cut by owner (target, drafter, data, objective, optim, train,
checkpoint, eval, pipeline). A key of the old sections (model.*, train.eval_*, data.eval_*, ...)
given by a user is refused naming its new name; a config the tool itself saved in the old sections
(a checkpoint's config.json) is translated by the same table, so an old checkpoint still resumes."""

from __future__ import annotations

import dataclasses
import json
import logging
import typing

import pytest

from conftest import overrides
from flashdraft.checkpoint import CheckpointManager
from flashdraft.cli import main
from flashdraft.config import RENAMED, Config, field_docs, load_config, upgrade_saved
from flashdraft.train.trainer import Trainer

SECTIONS = ["target", "drafter", "data", "objective", "optim", "train", "checkpoint", "eval", "pipeline"]


def old_format(values: dict) -> dict:
    """``values`` (Config.to_dict) as the code before the cut wrote it: every renamed key under its
    old section and name."""
    old = {section: dict(fields) for section, fields in values.items()}
    for before, after in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = before.split("."), after.split(".")
        old.setdefault(old_section, {})[old_key] = old[new_section].pop(new_key)
    return {section: fields for section, fields in old.items() if fields}


def test_the_sections_are_cut_by_owner_and_every_old_key_has_a_new_home():
    assert [f.name for f in dataclasses.fields(Config)] == SECTIONS
    hints = typing.get_type_hints(Config)
    known = {f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(hints[s])}
    assert set(RENAMED.values()) <= known and len(set(RENAMED.values())) == len(RENAMED)
    assert not set(RENAMED) & known  # no new key is an old one: the rename is idempotent
    assert old_format(Config().to_dict()).keys() == {"model", "data", "objective", "optim", "train",
                                                     "pipeline"}


@pytest.mark.parametrize(("old", "new", "value"), [
    ("model.num_draft_layers", "drafter.num_layers", "3"),
    ("model.target", "target.path", "/models/x"),
    ("model.drafter", "drafter.family", "dflash2"),
    ("model.target_backend", "target.backend", "vllm"),
    ("train.eval_every", "eval.every", "10"),
    ("train.eval_prompts", "eval.num_prompts", "4"),
    ("train.resume", "checkpoint.resume", "never"),
    ("data.eval_prompts", "eval.prompts_path", "p.jsonl"),
    ("data.eval_path", "eval.data_path", "held"),
])
def test_an_old_key_as_an_override_or_in_yaml_is_refused_naming_the_new_key(tmp_path, old, new, value):
    wanted = rf"config {old} was renamed {new}\b"
    with pytest.raises(ValueError, match=wanted):
        load_config(overrides=[f"{old}={value}"])
    with pytest.raises(ValueError, match=wanted):
        main(["config", f"{old}={value}"])
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ValueError, match=wanted):
        load_config(path)
    new_section, new_key = new.split(".")
    path.write_text(f"{new_section}:\n  {new_key}: {value}\n")
    assert str(getattr(getattr(load_config(path), new_section), new_key)) == value


def test_every_old_key_of_a_file_is_named_at_once_and_an_unknown_model_key_names_the_new_sections(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  target: /m\n  block_size: 8\ntrain:\n  save_every: 5\n")
    with pytest.raises(ValueError, match=r"model.target was renamed target.path, model.block_size was "
                                         r"renamed drafter.block_size, train.save_every was renamed "
                                         r"checkpoint.save_every"):
        load_config(path)
    with pytest.raises(ValueError,
                       match=r"model.nonsense: the model section was split into target and drafter"):
        load_config(overrides=["model.nonsense=1"])


def test_a_saved_old_config_is_translated_by_the_same_table():
    config = load_config(overrides=["drafter.block_size=8", "eval.every=3", "checkpoint.keep_last=2",
                                    "target.layer_ids=[1, 2]", "eval.prompts_path=p.jsonl"])
    old = old_format(config.to_dict())
    assert old["model"]["block_size"] == 8 and old["train"]["eval_every"] == 3 and old["data"]["eval_prompts"]
    assert upgrade_saved(old) == config.to_dict()
    assert upgrade_saved(config.to_dict()) == config.to_dict()  # today's sections come back unchanged


def test_a_checkpoint_saved_with_the_old_sections_resumes(tiny_job, tmp_path, caplog):
    """A run of the code before the cut saved Config.to_dict() in the old sections as the
    checkpoint's config.json (next to the manifest, which lists its digest): it resumes, its
    RESUME fields compared under their new names, and its export finds the run's target."""
    from flashdraft import export

    out = tmp_path / "run"
    first = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=3)))
    first.checkpoints.run_config = old_format(first.config.to_dict())  # the config.json the old code wrote
    path = first.checkpoints.save(1)
    saved = json.loads((path / "config.json").read_text())
    assert saved["model"]["target"] == str(tiny_job / "target") and "drafter" not in saved  # the old format
    loaded = CheckpointManager(out / "checkpoints").load_latest()
    assert loaded.config == first.config.to_dict()
    assert export._target_dir(loaded.config, path) == str(tiny_job / "target")

    with pytest.raises(ValueError, match=r"the config changed \(drafter.block_size: checkpoint 4 vs now 8\)"):
        Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=3,
                                                drafter__block_size=8))).fit()
    resumed = Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=3)))
    with caplog.at_level(logging.WARNING):
        resumed.fit()
    assert "resumed from step 1" in caplog.text and resumed.step == 3


def test_flashdraft_config_lists_every_field_of_every_section_with_its_comment(capsys):
    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    hints = typing.get_type_hints(Config)
    assert [ln[:-1] for ln in lines if ln and not ln.startswith((" ", "#"))] == SECTIONS
    for section in SECTIONS:
        cls = hints[section]
        docs = field_docs(cls)
        start = lines.index(f"{section}:")
        body = lines[start + 1:start + 1 + len(dataclasses.fields(cls))]
        assert ([ln.split(":", 1)[0].strip() for ln in body]
                == [f.name for f in dataclasses.fields(cls)]), section
        for f, line in zip(dataclasses.fields(cls), body):
            assert len(docs[f.name]) > 10 and line.endswith(f"  # {docs[f.name]}"), (section, f.name, line)
    text = "\n".join(lines)
    assert "drafter:\n  family: dflash  # drafter family: dflash | dflash2" in text
    assert "eval:\n  every: 0  # steps between evaluations" in text


def test_a_run_trained_without_accept_until_fail_is_not_resumed_with_it(tiny_job, tmp_path):
    """accept_until_fail became the default: re-running the command of a run trained without it
    (the key never named) would switch its objective mid-run; the resume is refused, naming it."""
    from flashdraft.train.trainer import Trainer, train

    out = tmp_path / "run"
    train(load_config(overrides=overrides(tiny_job, out, train__max_steps=2, checkpoint__save_every=1,
                                          objective__accept_until_fail="false")))
    with pytest.raises(ValueError, match=r"objective.accept_until_fail: checkpoint False vs now True"):
        with Trainer(load_config(overrides=overrides(tiny_job, out, train__max_steps=2,
                                                     checkpoint__save_every=1))) as trainer:
            trainer.fit()
