"""`flashdraft export`: the serving-format drafter of any complete checkpoint, verified, atomic."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch

from conftest import overrides
from flashdraft.checkpoint import CheckpointDir, CheckpointError, CheckpointManager
from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tiny_job, tmp_path_factory):
    """A 6-step run with checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("export") / "run"
    train(load_config(overrides=overrides(tiny_job, out, train__max_steps=6, checkpoint__save_every=2)))
    return out


def _outputs(drafter: DFlashDrafter) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    bs, hidden = drafter.block_size, drafter.config["hidden_size"]
    features = torch.randn(2, 20, len(drafter.target_layer_ids) * hidden, generator=g)
    blocks = torch.randn(2, 3, bs, hidden, generator=g)
    anchors, valid = torch.tensor([[3, 7, 12], [1, 9, 15]]), torch.ones(2, 3, dtype=torch.bool)
    with torch.no_grad():
        return drafter.eval()(features, blocks, anchors, valid)


def test_export_of_a_mid_run_checkpoint_is_the_drafter_of_that_step(run_dir, tmp_path, capsys):
    out = tmp_path / "step4"
    assert main(["export", str(run_dir), "--out", str(out), "--step", "4", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    state = CheckpointManager(run_dir / "checkpoints").load(run_dir / "checkpoints" / "step_00000004").parts["drafter"]
    exported = DFlashDrafter.from_pretrained(out)
    for name, value in state.items():
        assert torch.equal(exported.state_dict()[name], value), name
    at_step = DFlashDrafter(json.loads((out / "config.json").read_text()))
    at_step.load_state_dict(state)
    assert torch.equal(_outputs(exported), _outputs(at_step))
    final = DFlashDrafter.from_pretrained(run_dir / "drafter")  # step 6: another drafter
    assert not torch.equal(_outputs(exported), _outputs(final))
    assert "exported step 4" in printed and f"--speculative-draft-model-path {out.resolve()}" in printed
    vllm = next(line for line in printed.splitlines() if "vllm serve" in line)
    spec = json.loads(vllm.split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "dflash", "model": str(out.resolve()), "num_speculative_tokens": 3}  # block 4


def test_the_default_export_is_the_newest_checkpoint_in_bf16_and_replaces_an_earlier_export(run_dir, tmp_path):
    out = tmp_path / "newest"
    assert main(["export", str(run_dir / "checkpoints" / "step_00000002"), "--out", str(out)]) == 0
    assert main(["export", str(run_dir), "--out", str(out)]) == 0  # replaces the step-2 export
    state = CheckpointManager(run_dir / "checkpoints").load_latest().parts["drafter"]
    exported = DFlashDrafter.from_pretrained(out, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for name, value in state.items():
        assert torch.equal(exported.state_dict()[name], value.to(torch.bfloat16)), name
    assert [p.name for p in tmp_path.iterdir()] == ["newest"]  # no temporary directory left


def test_an_export_that_fails_at_its_rename_leaves_the_earlier_export_in_place(run_dir, tmp_path, monkeypatch):
    import os

    out = tmp_path / "export"
    assert main(["export", str(run_dir / "checkpoints" / "step_00000002"), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def fails_renaming_the_new_export_in(src, dst):
        if str(dst) == str(out / "config.json"):  # the first of the export's files renamed into place
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fails_renaming_the_new_export_in)
    with pytest.raises(ValueError, match="cannot write the export there .No space left on device"):
        main(["export", str(run_dir), "--out", str(out)])
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # nothing hidden left beside it


def test_a_corrupt_checkpoint_is_refused_with_the_reason(run_dir, tmp_path):
    damaged = tmp_path / "run"
    import shutil

    shutil.copytree(run_dir, damaged)
    weights = damaged / "checkpoints" / "step_00000006" / "drafter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"drafter.safetensors: sha256 mismatch"):
        main(["export", str(damaged), "--out", str(tmp_path / "e"), "--step", "6"])
    assert not (tmp_path / "e").exists()
    with pytest.raises(ValueError, match=r"has no checkpoint of step 5; it has steps 6, 4, 2"):
        main(["export", str(damaged), "--out", str(tmp_path / "e"), "--step", "5"])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a drafter export"):
        main(["export", str(run_dir), "--out", str(tmp_path / "notes")])
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    inside = run_dir / "checkpoints" / "step_00000006" / "export"  # would damage the checkpoint it reads
    with pytest.raises(ValueError, match=r"lies inside .*checkpoints, a training run's checkpoints"):
        main(["export", str(run_dir), "--out", str(inside)])
    with pytest.raises(ValueError, match=r"lies inside"):
        main(["export", str(run_dir), "--out", str(run_dir / "checkpoints" / "step_00000020")])
    with pytest.raises(ValueError, match="no checkpoints"):
        main(["export", str(tmp_path / "notes"), "--out", str(tmp_path / "e")])
    with pytest.raises(ValueError, match=r"--out .*todo.txt/e: cannot write the export there"):
        main(["export", str(run_dir), "--out", str(tmp_path / "notes" / "todo.txt" / "e")])
    with pytest.raises(ValueError, match=r"todo.txt: not a directory"):
        main(["export", str(tmp_path / "notes" / "todo.txt"), "--out", str(tmp_path / "e")])


def test_the_readme_serving_lines_say_what_the_engines_read():
    """vLLM takes a draft for DFlash only with method "dflash" (or "dflash" in its path) and wants
    block_size - 1 speculative tokens; SGLang wants the algorithm DFLASH and block_size draft tokens."""
    from conftest import REPO
    from flashdraft.config import DrafterConfig
    from flashdraft.export import serving_commands

    text = (REPO / "README.md").read_text()
    bs = DrafterConfig().block_size
    vllm = text.split("vllm serve /models/Qwen3-8B --speculative-config \\\n", 1)[1].split("\n", 1)[0].strip()
    spec = json.loads(vllm.strip("'"))
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == bs - 1
    sglang = text.split("python -m sglang.launch_server ", 1)[1].split("\nvllm serve", 1)[0].replace("\\\n", " ")
    for flag in ("--model-path /models/Qwen3-8B", "--speculative-algorithm DFLASH",
                 f"--speculative-num-draft-tokens {bs}", f"--speculative-draft-model-path {spec['model']}"):
        assert flag in " ".join(sglang.split()), flag
    printed = serving_commands("/models/Qwen3-8B", spec["model"], bs)  # what `flashdraft export` prints
    quoted = serving_commands("/my models/q", "/out/it's here", bs)  # paths a shell would split
    assert shlex.split(quoted[0])[4] == "/my models/q" and "/out/it's here" in shlex.split(quoted[0])
    assert json.loads(shlex.split(quoted[1])[-1])["model"] == "/out/it's here"
    assert json.loads(printed[1].split("--speculative-config ", 1)[1].strip("'")) == spec
    assert printed[0].split()[3:] == sglang.split()  # the same flags and values
    # sliding-window and full layers mixed: vLLM serves those on its V2 model runner only (DFLASH2.md 3.2)
    mixed = serving_commands("/models/Qwen3-8B", spec["model"], bs, v2_runner=True)
    assert mixed[1].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ") and mixed[0] == printed[0]


def test_export_never_writes_into_any_runs_checkpoints(run_dir, tmp_path):
    """Issue 31 #1: the guard protected only the source run; --out inside another run's newest
    checkpoint damaged it (its manifest check failed, and that run resumed two steps back)."""
    import shutil

    other = tmp_path / "B"
    shutil.copytree(run_dir / "checkpoints", other / "checkpoints", symlinks=True)
    for out in (other / "checkpoints" / "step_00000006" / "export", other / "checkpoints" / "step_00000008"):
        with pytest.raises(ValueError, match=r"lies inside .*B/checkpoints.*a training run's checkpoints"):
            main(["export", str(run_dir), "--out", str(out)])
    assert CheckpointManager(other / "checkpoints").latest_complete().name == "step_00000006"
    assert not (other / "checkpoints" / "step_00000008").exists()


def test_a_checkpoint_pruned_by_its_training_run_mid_export_still_exports(run_dir, tmp_path, monkeypatch):
    """Issue 31 #11: export read the checkpoint in place, and a run still training pruned it
    mid-read ("no manifest.json"). It reads a hard-linked snapshot now: here the run's real
    pruning removes step 4 after the snapshot, just before the files are read."""
    import shutil

    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", root, symlinks=True)
    real_load = CheckpointManager.load

    def load_after_a_prune(self, path, *args, **kwargs):
        CheckpointDir(root, keep_last=1).prune(6, "step_00000006")  # what the trainer's next save does
        return real_load(self, path, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "load", load_after_a_prune)
    assert main(["export", str(tmp_path / "run"), "--step", "4", "--out", str(tmp_path / "e")]) == 0
    assert not (root / "step_00000004").exists()
    step4 = CheckpointManager(run_dir / "checkpoints").load(run_dir / "checkpoints" / "step_00000004")
    exported = DFlashDrafter.from_pretrained(tmp_path / "e")
    for name, value in step4.parts["drafter"].items():
        assert torch.equal(exported.state_dict()[name], value.to(torch.bfloat16).float())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "run"]  # the snapshot is gone


def test_a_checkpoint_copied_elsewhere_exports_with_its_step(run_dir, tmp_path):
    import shutil

    shutil.copytree(run_dir / "checkpoints" / "step_00000004", tmp_path / "best")
    assert main(["export", str(tmp_path / "best"), "--step", "4", "--out", str(tmp_path / "e")]) == 0
    with pytest.raises(ValueError, match=r"best is the checkpoint of step 4, not --step 6"):
        main(["export", str(tmp_path / "best"), "--step", "6", "--out", str(tmp_path / "e")])


def test_an_export_into_a_cloned_drafter_repository_replaces_only_its_own_files(run_dir, tmp_path):
    """A drafter repository cloned from a hub holds .git/, README.md, .gitattributes beside the
    export: a new export replaces config.json and model.safetensors and leaves the rest alone
    (it used to replace the whole directory)."""
    repo = tmp_path / "repo"
    assert main(["export", str(run_dir / "checkpoints" / "step_00000002"), "--out", str(repo)]) == 0
    others = {".git/config": "[core]\n", ".git/HEAD": "ref: refs/heads/main\n", "README.md": "# my drafter\n",
              ".gitattributes": "*.safetensors filter=lfs\n"}
    for name, text in others.items():
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_text(text)
    assert main(["export", str(run_dir), "--out", str(repo)]) == 0  # step 6 over step 2
    assert {name: (repo / name).read_text() for name in others} == others
    state = CheckpointManager(run_dir / "checkpoints").load_latest().parts["drafter"]
    exported = DFlashDrafter.from_pretrained(repo, dtype=torch.bfloat16)
    assert all(torch.equal(exported.state_dict()[k], v.to(torch.bfloat16)) for k, v in state.items())
    assert sorted(p.name for p in repo.iterdir()) == sorted([".git", ".gitattributes", "README.md", "config.json",
                                                             "model.safetensors"])
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # no temporary directory left beside it


def test_links_planted_at_the_exports_temporary_names_are_never_followed(run_dir, tmp_path):
    """In a shared directory another user could plant links where the export's temporary files
    would be (they were named .OUT.tmp-PID, .OUT.old-PID, .model.safetensors.tmp-PID): the export
    makes new names of its own (tempfile) and writes nothing through them."""
    import os

    from flashdraft.drafter.serving import write_export

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    (victim / "model.safetensors").write_bytes(b"not yours")
    out, pid = tmp_path / "shared" / "out", os.getpid()
    out.parent.mkdir()
    for name in (f".out.tmp-{pid}", f".out.old-{pid}"):
        (out.parent / name).symlink_to(victim)
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    (out / f".model.safetensors.tmp-{pid}").symlink_to(victim / "model.safetensors")  # the in-run writer's names
    (out / f".config.json.tmp-{pid}").symlink_to(victim / "precious.txt")
    drafter = DFlashDrafter.from_pretrained(out)
    write_export(out, {k: v.contiguous() for k, v in drafter.state_dict().items()}, drafter.config)
    assert sorted(p.name for p in victim.iterdir()) == ["model.safetensors", "precious.txt"]
    assert (victim / "precious.txt").read_text() == "mine"
    assert (victim / "model.safetensors").read_bytes() == b"not yours"
    assert out.is_dir() and not out.is_symlink() and DFlashDrafter.from_pretrained(out) is not None


def test_export_out_a_symbolic_link_is_refused_and_left_alone(run_dir, tmp_path):
    """--out LINK used to put a new directory where the link was and leave the link hidden beside
    it (.LINK.old-PID): refused, naming the link; the link and what it points at stay."""
    real = tmp_path / "real"
    assert main(["export", str(run_dir / "checkpoints" / "step_00000002"), "--out", str(real)]) == 0
    before = {p.name: p.read_bytes() for p in real.iterdir()}
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ValueError, match=r"--out .*link is a symbolic link \(to .*real\); give the directory itself"):
        main(["export", str(run_dir), "--out", str(tmp_path / "link")])
    assert (tmp_path / "link").is_symlink() and {p.name: p.read_bytes() for p in real.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.parametrize(("prompt", "refusal"), [
    ([1, 2, 400], r"prompt 2 has token id 400 outside the target's vocabulary \[0, 300\)"),
    ([3] * 500, r"prompt 2 has 500 tokens; with 64 new tokens and a block of 4 it needs 568 positions, more than "
                r"the target's max_position_embeddings=512"),
], ids=["out_of_vocabulary", "beyond_positions"])
def test_export_verify_engine_checks_its_prompts_before_exporting(run_dir, tmp_path, prompt, refusal):
    """An id outside the target's vocabulary, or a prompt its positions cannot hold, was a
    traceback mid-decode after the export was written; refused up front, as eval refuses them."""
    from flashdraft.evaluate import write_prompts

    write_prompts(tmp_path / "prompts.jsonl", [[1, 2, 3], prompt])
    with pytest.raises(ValueError, match=refusal):
        main(["export", str(run_dir), "--out", str(tmp_path / "out"), "--verify-engine", "vllm", "--prompts",
              str(tmp_path / "prompts.jsonl")])
    assert not (tmp_path / "out").exists()


# ---- issue 31, 12: export prints the target's absolute path --------------------------------------

def test_export_prints_the_absolute_target_of_a_run_trained_with_relative_paths(tiny_job, tmp_path, monkeypatch,
                                                                                 capsys):
    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    monkeypatch.chdir(tiny_job)  # trained with target.path=target, train.output_dir=rel/run
    given = overrides(tiny_job, tmp_path, train__max_steps=1, target__path="target", train__output_dir="rel/run")
    train(load_config(overrides=given))
    monkeypatch.chdir(tmp_path)  # exported from elsewhere
    assert main(["export", str(tiny_job / "rel" / "run"), "--out", "exp"]) == 0
    out = capsys.readouterr().out
    assert f"--model-path {tiny_job / 'target'} " in out and f"vllm serve {tiny_job / 'target'} " in out
    assert f"--speculative-draft-model-path {tmp_path / 'exp'} " in out


# ---- issue 31, 16: the loader names a tampered export in whole sentences -------------------------

def test_a_tampered_export_is_named_in_whole_sentences(eval_dir, tmp_path):
    import shutil

    from flashdraft.drafter import DFlashDrafter

    bad = tmp_path / "drafter"
    shutil.copytree(eval_dir / "drafter", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["DFlash2DraftModel"],
                                                 "final_logit_softcapping": 30.0}))
    with pytest.raises(ValueError) as exc:
        DFlashDrafter.from_pretrained(bad)
    said = str(exc.value)
    assert said.startswith(f"{bad / 'config.json'}: this DFlash drafter uses what flashdraft does not implement")
    assert "(vLLM requires all four); got" in said and said.endswith("final_logit_softcapping=30.0.")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad / 'config.json'))}: cannot read the drafter's config"):
        DFlashDrafter.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes(b"\x00" * 8)
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad / 'model.safetensors'))}: cannot read the drafter's "
                                         "weights"):
        DFlashDrafter.from_pretrained(bad)


# ---- issue 31, the trial's re-run (h31b): defects its probes found -------------------------------

def test_export_refuses_verify_engine_knobs_without_it(eval_dir, tmp_path):
    for extra in (["--prompts", str(eval_dir / "prompts.jsonl")], ["--max-new-tokens", "8"],
                  ["--engine-python", "/opt/vllm/bin/python"]):
        with pytest.raises(ValueError, match=r"--prompts / --max-new-tokens / --engine-python set how --verify-engine "
                                             "decodes"):
            main(["export", str(tmp_path / "no-run"), "--out", str(tmp_path / "e"), *extra])


def test_an_export_whose_mask_id_or_shapes_do_not_fit_is_named(eval_dir, tmp_path):
    import shutil

    from flashdraft.drafter import DFlashDrafter

    bad = tmp_path / "drafter"
    shutil.copytree(eval_dir / "drafter", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "dflash_config": {**config["dflash_config"],
                                                                             "mask_token_id": 10 ** 9}}))
    with pytest.raises(ValueError, match=r"dflash_config.mask_token_id=1000000000 is no id of its vocabulary"):
        DFlashDrafter.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    with pytest.raises(ValueError, match=r"model.safetensors does not fit its config.json \(size mismatch"):
        DFlashDrafter.from_pretrained(bad)


@pytest.mark.parametrize("saved", [{"eval": {"prompts_path": "/data/p.jsonl"}},  # today's sections
                                   {"data": {"eval_prompts": "/data/p.jsonl"}}],  # a checkpoint from before
                         ids=["eval_section", "old_data_section"])
def test_verify_engine_defaults_to_the_runs_eval_prompts_in_either_config_layout(tmp_path, saved):
    """--verify-engine without --prompts takes the run's eval.prompts_path from the checkpoint's
    config; it read the old key only, so a run saved after the config's cut had none."""
    from flashdraft.export import _run_eval_prompts

    (tmp_path / "config.json").write_text(json.dumps({**saved, "train": {"output_dir": "run"}}))
    assert _run_eval_prompts(tmp_path) == "/data/p.jsonl"
