"""The config is discoverable: `train --help` lists every field with its type, default and doc,
generated from the dataclasses; `flashdraft config` prints a YAML that loads back to the same config."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from flashdraft.cli import main
from flashdraft.config import Config, field_docs, load_config, save_config, to_yaml


def _sections():
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def test_every_field_has_a_doc_read_from_its_comment():
    docs = field_docs(_sections()[0][1])
    assert docs["target"] == "local directory of the Hugging Face target model (config.json + weights)"
    # a comment line above the field is part of its doc
    assert docs["drafter_attention"].endswith("; auto: flex on CUDA, else blockwise")
    for section, cls in _sections():
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, section
        assert all(len(doc) > 10 for doc in docs.values()), (section, docs)


def test_train_help_lists_every_field_of_every_section(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for section, cls in _sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            line = next((ln for ln in text.splitlines() if ln.strip().startswith(f"{section}.{f.name}:")), None)
            assert line is not None, f"{section}.{f.name} missing from train --help"
            assert str(f.type) in line, line
            shown = yaml.safe_load(line.split(" = ", 1)[1])
            assert shown == (list(default) if isinstance(default, tuple) else default), line
            assert docs[f.name] in text
    assert "flashdraft config" in text


def test_flashdraft_config_prints_yaml_that_loads_back_to_the_same_config(tmp_path, capsys):
    assert main(["config"]) == 0
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(capsys.readouterr().out)
    assert load_config(defaults) == Config()
    overrides = ["optim.lr=3e-4", "model.target_layer_ids=[1, 9, 17]", "data.eval_path=held out/data",
                 "train.metrics=[jsonl, tensorboard]", "pipeline.feature_cache_bytes=64e9", "objective.gamma=null",
                 "model.mask_token_id=151669", "train.max_steps=100"]
    assert main(["config", *overrides]) == 0
    written = tmp_path / "run.yaml"
    written.write_text(capsys.readouterr().out)
    expected = load_config(overrides=overrides)
    assert load_config(written) == expected and expected != Config()
    assert "# peak learning rate (AdamW)" in written.read_text()  # documented
    save_config(expected, tmp_path / "saved.yaml")  # what every run saves next to its output
    assert load_config(tmp_path / "saved.yaml") == expected
    assert to_yaml(expected) == written.read_text()


def test_flashdraft_config_refuses_a_bad_value_naming_the_field():
    with pytest.raises(ValueError, match=r"config model.block_size=1 is invalid"):
        main(["config", "model.block_size=1"])
    with pytest.raises(ValueError, match=r"unknown key optim.learning_rate"):
        main(["config", "optim.learning_rate=1e-3"])


def test_a_missing_or_malformed_config_file_is_named_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"nope.yaml: cannot read the config file \(No such file or directory\)"):
        main(["config", "--config", str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  block_size: [8\n")
    with pytest.raises(ValueError, match=r"bad.yaml: not valid YAML at line 3, column 1"):
        main(["config", "--config", str(bad)])
    with pytest.raises(ValueError, match=r"--output .*afile: cannot use it as the output directory"):
        (tmp_path / "afile").write_text("")
        main(["quickstart", "--smoke", "--output", str(tmp_path / "afile")])
