"""`flashdraft eval` on bad or mismatched inputs: clear errors before any decoding."""

import json
import re

import pytest

from conftest import VOCAB, make_drafter, tiny_qwen3
from flashdraft.cli import main
from flashdraft.evaluate import write_prompts
from flashdraft.target import TargetModel


@pytest.fixture(scope="module")
def shallow_target(tmp_path_factory):
    """A 4-layer target: too shallow for the default 5-tap spread, which the n-gram baseline never needs."""
    d = tmp_path_factory.mktemp("eval")
    tiny_qwen3(num_layers=4, seed=1).save_pretrained(d / "target")
    write_prompts(d / "prompts.jsonl", [[1, 2, 3, 4], [5, 6, 7]])
    return d


def test_ngram_baseline_runs_on_any_target_depth(shallow_target, capsys):
    d = shallow_target
    assert main(["eval", "--target", str(d / "target"), "--baseline", "ngram", "--prompts", str(d / "prompts.jsonl"),
                 "--max-new-tokens", "6", "--block-size", "4", "--device", "cpu"]) == 0
    assert '"lossless": true' in capsys.readouterr().out


def test_prompts_outside_the_targets_vocabulary_are_refused_with_the_line(shallow_target, tmp_path):
    d = shallow_target
    write_prompts(tmp_path / "bad.jsonl", [[1, 2], [3, VOCAB + 5]])
    with pytest.raises(ValueError, match=rf"(?s)bad.jsonl: prompt 2 has token id {VOCAB + 5}.*"
                                         rf"vocabulary \[0, {VOCAB}\)"):
        main(["eval", "--target", str(d / "target"), "--baseline", "ngram", "--prompts", str(tmp_path / "bad.jsonl"),
              "--device", "cpu"])


def test_a_drafter_of_another_target_is_refused(shallow_target, tmp_path):
    d = shallow_target
    other = TargetModel(tiny_qwen3(num_layers=4, hidden=32), [1, 2])
    make_drafter(other, num_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"drafter was trained for another target .*hidden_size 32 vs 64"):
        main(["eval", "--target", str(d / "target"), "--drafter", str(tmp_path / "drafter"),
              "--prompts", str(d / "prompts.jsonl"), "--device", "cpu"])


def test_an_unknown_dtype_is_refused(shallow_target, capsys):
    d = shallow_target
    assert main(["eval", "--target", str(d / "target"), "--baseline", "ngram", "--prompts", str(d / "prompts.jsonl"),
                 "--dtype", "bf16"]) == 2
    assert "--dtype 'bf16'" in capsys.readouterr().err


def test_a_prompt_too_long_for_the_targets_positions_is_refused_before_decoding(shallow_target, tmp_path):
    d = shallow_target  # max_position_embeddings 512
    write_prompts(tmp_path / "long.jsonl", [[1, 2], [3] * 500])
    with pytest.raises(ValueError, match=r"(?s)long.jsonl: prompt 2 has 500 tokens.*64 new tokens.*block of 4.*568 "
                                         r"positions.*max_position_embeddings=512"):
        main(["eval", "--target", str(d / "target"), "--baseline", "ngram", "--prompts", str(tmp_path / "long.jsonl"),
              "--max-new-tokens", "64", "--block-size", "4", "--device", "cpu"])


def test_the_target_directory_given_as_drafter_and_an_unwritable_output_are_refused_up_front(shallow_target,
                                                                                             tmp_path):
    d = shallow_target
    with pytest.raises(ValueError, match=r"target/config.json: not a DFlash or DFlash2 drafter"):
        main(["eval", "--target", str(d / "target"), "--drafter", str(d / "target"),
              "--prompts", str(d / "prompts.jsonl"), "--device", "cpu"])
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"--output .*afile/report.json: cannot write the report there"):
        main(["eval", "--target", str(d / "target"), "--baseline", "ngram", "--prompts", str(d / "prompts.jsonl"),
              "--output", str(tmp_path / "afile" / "report.json"), "--device", "cpu"])


def test_sampled_eval_reports_tau_per_setting_and_is_reproducible(shallow_target, tmp_path, capsys):
    import json

    d = shallow_target
    target = TargetModel.from_pretrained(d / "target", target_layer_ids=[1, 2], device="cpu")
    make_drafter(target, num_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    base = ["eval", "--target", str(d / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts",
            str(d / "prompts.jsonl"), "--max-new-tokens", "12", "--device", "cpu"]
    reports = []
    for extra in ([], ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.95", "--seed", "3"],
                  ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.95", "--seed", "3"]):
        assert main(base + extra + ["--output", str(tmp_path / "r.json")]) == 0
        reports.append(json.loads((tmp_path / "r.json").read_text()))
    capsys.readouterr()
    greedy, sampled, again = reports
    assert greedy["lossless"] is True and greedy["settings"]["greedy"] is True
    assert sampled["settings"] == {"max_new_tokens": 12, "block_size": 4, "greedy": False, "drafter": "dflash",
                                   "temperature": 0.8, "top_p": 0.95, "top_k": 20, "seed": 3}
    assert "lossless" not in sampled and sampled["speedup"] > 0 and sampled["sampled_seconds"] > 0
    assert sampled["tau"] >= 1 and len(sampled["per_position_acceptance"]) == 3
    assert (sampled["tau"], sampled["new_tokens"]) == (again["tau"], again["new_tokens"])  # same seed, same run
    for bad, match in ((["--temperature", "-1"], "--temperature"), (["--temperature", "1", "--top-p", "0"], "--top-p"),
                       (["--top-k", "5"], "give a --temperature")):
        with pytest.raises(ValueError, match=match):
            main(base + bad)


def test_eval_on_a_hybrid_target_whose_rewind_is_broken_stops_in_one_line_before_decoding(tmp_path, monkeypatch,
                                                                                           capsys):
    """`flashdraft eval` runs the rewind self-check before its first decode: a rewind that forgets
    the recurrent state (a wrong description, as a new transformers could make it) exits 2 with
    one line naming the fix, and writes no report that could be read as a verdict."""
    from conftest import tiny_qwen3_5
    from flashdraft.cli import entry
    from flashdraft.target import rewind

    tiny_qwen3_5(seed=1).save_pretrained(tmp_path / "target")
    write_prompts(tmp_path / "prompts.jsonl", [[1, 2, 3, 4], [5, 6, 7]])
    monkeypatch.setattr(rewind, "LINEAR_STATE", tuple(f for f in rewind.LINEAR_STATE if f != "recurrent_states"))
    monkeypatch.setattr(rewind, "LINEAR_INERT", rewind.LINEAR_INERT + ("recurrent_states",))
    code = entry(["eval", "--target", str(tmp_path / "target"), "--baseline", "ngram", "--prompts",
                  str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "6", "--block-size", "4", "--device", "cpu",
                  "--output", str(tmp_path / "report.json")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("flashdraft")]  # not the loaders' progress bars
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("flashdraft eval: error: the target's KV-cache rewind is not exact on transformers")
    assert "tested range (pyproject.toml)" in lines[0]
    assert not (tmp_path / "report.json").exists()


# ---- where eval --output may write, and how (flashdraft.outputs) ---------------------------------


def _ngram(target, prompts, output, *extra):
    return main(["eval", "--target", str(target), "--baseline", "ngram", "--prompts", str(prompts), "--block-size",
                 "4", "--max-new-tokens", "4", "--device", "cpu", "--output", str(output), *extra])


def test_eval_output_never_writes_through_a_link_into_a_model_or_onto_its_prompts(shallow_target, tmp_path):
    """A target in the Hugging Face cache layout (snapshots/REV/NAME -> ../../blobs/SHA): --output
    onto one of its files is refused, whichever name reaches it; so is a hard link of --prompts.
    Each file is compared by (st_dev, st_ino) with the inputs' files. Before: exit 0, and the
    blob (or the prompts) held the report."""
    import os
    import shutil

    hub = tmp_path / "models--org--tiny"
    (hub / "blobs").mkdir(parents=True)
    (hub / "snapshots" / "rev").mkdir(parents=True)
    for i, f in enumerate(sorted((shallow_target / "target").iterdir())):
        shutil.copy(f, hub / "blobs" / f"sha{i}")
        (hub / "snapshots" / "rev" / f.name).symlink_to(f"../../blobs/sha{i}")
    target = hub / "snapshots" / "rev"
    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(shallow_target / "prompts.jsonl", prompts)
    os.link(prompts, tmp_path / "hardlink.jsonl")
    (tmp_path / "elsewhere.json").symlink_to(hub / "blobs" / "sha0")
    before = {p: p.read_bytes() for p in [*(hub / "blobs").iterdir(), prompts]}
    for victim, why in [(target / "config.json", "lies inside .*rev, an input"),
                        (target / "model.safetensors", "lies inside .*rev, an input"),
                        (tmp_path / "hardlink.jsonl", "is the file .*prompts.jsonl \\(a hard link of it\\)"),
                        (tmp_path / "elsewhere.json", "is the file .*rev/config.json \\(a symbolic link of it\\)")]:
        with pytest.raises(ValueError, match=rf"--output {victim} {why}"):
            _ngram(target, prompts, victim)
    assert {p: p.read_bytes() for p in before} == before
    assert _ngram(target, prompts, tmp_path / "report.json") == 0  # the same target, a file of its own: written
    assert json.loads((tmp_path / "report.json").read_text())["num_prompts"] == 2


def test_eval_output_a_named_pipe_gets_the_whole_report_without_hanging(shallow_target, tmp_path):
    """A reader on a named pipe gets the report (before: eval opened the pipe to probe it at the
    start, which ended the reader's input, then hung at the end waiting for another reader)."""
    import os
    import threading

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    codes = []
    writer = threading.Thread(target=lambda: codes.append(_ngram(shallow_target / "target",
                                                                 shallow_target / "prompts.jsonl", fifo)), daemon=True)
    writer.start()
    writer.join(timeout=120)
    if writer.is_alive():  # hung: release it (a reader of its own) before failing
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join(timeout=10)
        os.close(fd)
        pytest.fail("eval --output FIFO hung")
    reader.join(timeout=10)
    assert codes == [0] and json.loads(received[0])["num_prompts"] == 2


def test_eval_output_never_overwrites_a_runs_own_export_or_logs(tiny_job, tmp_path):
    """RUN/drafter/config.json, RUN/metrics.jsonl, RUN/config.yaml: outputs of a training run that
    only that run writes (its export is served, its metrics are its record); a new file in the run
    directory is fine."""
    from conftest import overrides
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    run = tmp_path / "run"
    train(load_config(overrides=overrides(tiny_job, run, train__max_steps=2)))
    prompts = tiny_job / "prompts.jsonl"
    for own in ("drafter/config.json", "drafter", "metrics.jsonl", "config.yaml"):
        before = (run / own).read_bytes() if (run / own).is_file() else None
        with pytest.raises(ValueError, match=rf"--output .*{own} (is|lies inside) .*, an output of the training run "
                                             r"in .*run \(its \w+(\.\w+)?\), which only that run writes"):
            _ngram(tiny_job / "target", prompts, run / own)
        assert before is None or (run / own).read_bytes() == before
    assert _ngram(tiny_job / "target", prompts, run / "eval-report.json") == 0


# ---- issue 31's adversarial trials: the numbers are the rows of its table in docs/reliability.md ---------

def _eval(d, *extra, drafter=True):
    return main(["eval", "--target", str(d / "target"), "--prompts", str(d / "prompts.jsonl"), "--device", "cpu",
                 *(["--drafter", str(d / "drafter")] if drafter else ["--baseline", "ngram"]), *extra])


# ---- issue 31, 2: eval --output never overwrites the command's own inputs ------------------------

@pytest.mark.parametrize("victim", ["prompts.jsonl", "target/config.json", "drafter/model.safetensors", "target"])
def test_eval_output_never_overwrites_its_own_inputs(eval_dir, victim):
    path = eval_dir / victim
    before = sorted(p.read_bytes() for p in ([path] if path.is_file() else path.iterdir()))
    with pytest.raises(ValueError, match=rf"--output .*{victim} (is|lies inside|holds) .*an input of this command"):
        _eval(eval_dir, "--output", str(path), "--max-new-tokens", "4")
    assert sorted(p.read_bytes() for p in ([path] if path.is_file() else path.iterdir())) == before


# ---- issue 31, 3: a tiny positive temperature is refused where it is given, not mid-run ----------

def test_a_temperature_below_the_minimum_is_refused_at_load_and_parse_and_the_minimum_decodes(eval_dir):
    from flashdraft.config import MIN_TEMPERATURE, load_config

    with pytest.raises(ValueError, match=r"(?s)eval.temperature=1e-40 is invalid.*use 0 \(greedy\).*"
                                         r"at least 0.0001"):
        load_config(overrides=["eval.temperature=1e-40"])
    with pytest.raises(ValueError, match=r"--temperature 1e-40: use 0 \(greedy\) or a finite temperature of at least"):
        _eval(eval_dir, "--temperature", "1e-40", "--max-new-tokens", "4")
    assert _eval(eval_dir, "--temperature", str(MIN_TEMPERATURE), "--max-new-tokens", "6") == 0


# ---- issue 31, 5, 6, 16: eval's block size, token count and report -------------------------------

def test_eval_refuses_a_block_size_the_drafter_does_not_decode_with_and_bad_counts_at_parse(eval_dir, capsys):
    with pytest.raises(ValueError, match=r"--block-size 8: .*drafter drafts blocks of 4, the size it decodes"):
        _eval(eval_dir, "--block-size", "8", "--max-new-tokens", "4")
    for flag, value in [("--block-size", "-3"), ("--block-size", "0"), ("--block-size", "1"),
                        ("--max-new-tokens", "0"), ("--max-new-tokens", "-5")]:
        with pytest.raises(SystemExit) as exc:
            _eval(eval_dir, flag, value, drafter=False)
        assert exc.value.code == 2 and f"argument {flag}: {value}: use" in capsys.readouterr().err
    assert _eval(eval_dir, "--block-size", "4", "--max-new-tokens", "6") == 0  # the drafter's own: accepted
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["block_size"] == 4 and report["settings"]["drafter"] == "dflash"


def test_the_eval_report_is_strict_json_when_no_tau_was_measured(eval_dir, tmp_path, capsys):
    from transformers import AutoConfig

    eos = tmp_path / "target"  # the same target, but every token it can emit ends the sequence
    import shutil
    shutil.copytree(eval_dir / "target", eos)
    config = AutoConfig.from_pretrained(eos)
    config.eos_token_id = list(range(config.vocab_size))
    config.save_pretrained(eos)
    (eos / "generation_config.json").unlink(missing_ok=True)
    out = tmp_path / "report.json"
    assert main(["eval", "--target", str(eos), "--drafter", str(eval_dir / "drafter"), "--prompts",
                 str(eval_dir / "prompts.jsonl"), "--device", "cpu", "--max-new-tokens", "4",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the report"))
    assert report["tau"] is None and report["lossless"] is True


# ---- issue 31, 16: messages name the flag, the file and the list's kind --------------------------

def test_eval_tensor_parallel_without_torchrun_names_the_flag(eval_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"(?s)--tensor-parallel 2 on WORLD_SIZE=1.*torchrun --nproc-per-node=2"):
        _eval(eval_dir, "--tensor-parallel", "2", "--max-new-tokens", "4")


# ---- issue 31, the trial's re-run (h31b): defects its probes found -------------------------------

def test_eval_names_a_bad_device_an_unreadable_prompts_file_and_refuses_two_subjects(eval_dir, tmp_path):
    import torch

    prompts = ["--prompts", str(eval_dir / "prompts.jsonl")]
    with pytest.raises(ValueError, match=r"--device 'tpu': not a device torch knows"):
        _eval(eval_dir, "--device", "tpu", *prompts)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"--device cuda:0: this torch sees no CUDA device; use --device cpu"):
            _eval(eval_dir, "--device", "cuda:0", *prompts)
    with pytest.raises(ValueError, match=r"--drafter and --baseline: evaluate one of them"):
        _eval(eval_dir, "--baseline", "ngram", *prompts)
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00\n")
    for bad in (tmp_path, tmp_path / "binary.jsonl"):
        with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}: cannot read the prompts .*give a UTF-8 JSONL"):
            _eval(eval_dir, "--prompts", str(bad))


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_eval_names_an_output_that_fails_at_the_write_and_keeps_the_report_on_stdout(eval_dir, capsys):
    with pytest.raises(ValueError, match=r"--output /dev/full: cannot write the report \(No space left on device\)"):
        _eval(eval_dir, "--prompts", str(eval_dir / "prompts.jsonl"), "--max-new-tokens", "2", "--output", "/dev/full")
    assert json.loads(capsys.readouterr().out)["num_prompts"] == 2
