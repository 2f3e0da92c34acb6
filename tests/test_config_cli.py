"""The config is discoverable: `train --help` lists every field with its type, default and doc,
generated from the dataclasses; `flashdraft config` prints a YAML that loads back to the same config."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from flashdraft.cli import main
from flashdraft.config import (
    DFLASH2,
    RESUME,
    Config,
    field_docs,
    load_config,
    marked_fields,
    save_config,
    to_yaml,
)


def _sections():
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def test_every_field_has_a_doc_read_from_its_comment():
    docs = field_docs(_sections()[0][1])
    assert docs["path"] == "local directory of the Hugging Face target model (config.json + weights)"
    # a comment line above the field is part of its doc
    assert field_docs(_sections()[1][1])["attention"].endswith("; auto: flex on CUDA, else blockwise")
    for section, cls in _sections():
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, section
        assert all(len(doc) > 10 for doc in docs.values()), (section, docs)
        # a divider above a group of fields is no field's doc; a line ending in ";" joins once
        assert not [k for k, doc in docs.items() if "----" in doc or ";;" in doc], (section, docs)
    assert field_docs(_sections()[0][1])["backend"] == (
        "who computes the target's features; transformers (in-process forward) | vllm (a vLLM engine in its "
        "own process; docs/architecture.md)")


def test_train_help_lists_every_field_of_every_section(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for section, cls in _sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            line = next((ln for ln in text.splitlines() if ln.strip().startswith(f"{section}.{f.name}:")),
                        None)
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
    overrides = ["optim.lr=3e-4", "target.layer_ids=[1, 9, 17]", "eval.data_path=held out/data",
                 "train.metrics=[jsonl, tensorboard]", "pipeline.feature_cache_bytes=64e9",
                 "objective.gamma=null", "drafter.mask_token_id=151669", "train.max_steps=100"]
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
    with pytest.raises(ValueError, match=r"config drafter.block_size=1 is invalid"):
        main(["config", "drafter.block_size=1"])
    with pytest.raises(ValueError, match=r"unknown key optim.learning_rate"):
        main(["config", "optim.learning_rate=1e-3"])


def test_a_missing_or_malformed_config_file_is_named_with_the_fix(tmp_path):
    with pytest.raises(ValueError,
                       match=r"nope.yaml: cannot read the config file \(No such file or directory\)"):
        main(["config", "--config", str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter:\n  block_size: [8\n")
    with pytest.raises(ValueError, match=r"bad.yaml: not valid YAML at line 3, column 1"):
        main(["config", "--config", str(bad)])
    with pytest.raises(ValueError, match=r"--output .*afile: cannot use it as the output directory"):
        (tmp_path / "afile").write_text("")
        main(["quickstart", "--smoke", "--output", str(tmp_path / "afile")])


def test_the_marked_field_lists_are_the_hand_kept_lists_they_replace():
    """The resume-invariant fields and DFlash2's knobs are derived from marks on the fields; here
    they are written out as they were kept by hand (train/state.py, Config.__post_init__), with the
    fields added since (drafter.init_from: a resume must start from the same released drafter;
    accept-until-fail: the objective became its default)."""
    resume = ([("target", k) for k in ("layer_ids", "num_taps")]
              + [("drafter", k) for k in ("num_layers", "block_size", "mask_token_id", "layer_types",
                                          "sliding_window", "causal", "attention_sink", "family",
                                          "conv_kernel_size", "conv_group_size", "selector_rank",
                                          "selector_top_k", "init_from")]
              + [("data", k) for k in ("token_budget", "max_batch_size", "max_length")] + [("train", "seed")]
              + [("objective", k) for k in ("accept_until_fail", "auf_factor")])
    # the same fields, listed in their declaration order now
    assert sorted(marked_fields(RESUME)) == sorted(resume)
    assert marked_fields(DFLASH2) == [("drafter", k) for k in ("conv_kernel_size", "conv_group_size",
                                                             "selector_rank", "selector_top_k")] \
        + [("objective", k) for k in ("selector_alpha", "selector_warmup_frac", "selector_ramp_frac",
                                      "selector_stop_gradient")]


def test_every_choice_the_config_offers_has_its_own_implementation():
    """The choice lists are declared in the config, their implementations live with their owners:
    each entry reaches code of its own (none falls through to another entry's branch)."""
    import torch

    from flashdraft.config import (
        ATTENTION_IMPLS,
        DRAFTERS,
        LAYER_TYPES,
        LOSSES,
        SINK_IMPLS,
        WEIGHTINGS,
        DrafterConfig,
        ObjectiveConfig,
    )
    from flashdraft.drafter.attention import attention_plan, resolve_attention
    from flashdraft.drafter.dflash2 import DFlash2Modules
    from flashdraft.drafter.serving import layer_attention
    from flashdraft.objective import SlotLoss

    cpu = torch.device("cpu")
    concrete = [impl for impl in ATTENTION_IMPLS if impl != "auto"]
    assert {resolve_attention(impl, cpu, needs_grad=False) for impl in ATTENTION_IMPLS} == set(concrete)
    anchors, valid = torch.tensor([[4, 9]]), torch.tensor([[True, True]])
    assert [attention_plan(impl, anchors, valid, 16, 4, needs_grad=False).impl
            for impl in concrete] == concrete
    for impl in ATTENTION_IMPLS:  # an implementation without a sink refuses one
        if impl in SINK_IMPLS:
            resolve_attention(impl, cpu, needs_grad=False, sinks=True)
        else:
            with pytest.raises(ValueError, match="has no attention sink"):
                resolve_attention(impl, cpu, needs_grad=False, sinks=True)
    masks = {layer_attention({"num_hidden_layers": 1, "layer_types": [t], "sliding_window": 4})[0]
             for t in LAYER_TYPES}
    assert len(masks) == len(LAYER_TYPES)
    ce, weights = torch.tensor([0.5, 1.0, 2.0]), torch.ones(3)
    correct = torch.ones(3, dtype=torch.bool)
    slot_sums = {SlotLoss(kind, kl_scale=0.5).rows(ce, ce, correct, weights, 3)[0].sum().item()
                 for kind in LOSSES}
    assert len(slot_sums) == len(LOSSES)
    assert len({SlotLoss.of(ObjectiveConfig(weighting=w)) for w in WEIGHTINGS}) == len(WEIGHTINGS)
    assert len({DFlash2Modules.of(DrafterConfig(family=d)) for d in DRAFTERS}) == len(DRAFTERS)
