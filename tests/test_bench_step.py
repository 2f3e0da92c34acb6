"""`flashdraft bench step` runs both variants on the same weights and inputs: their losses agree
(fp32, and under bf16 autocast as the trainer runs on CUDA), and it reports time and memory."""

from __future__ import annotations

import json

import pytest

from flashdraft.cli import main

POINT = ["--seq", "64", "--hidden", "64", "--layers", "2", "--anchors", "8", "--block", "4", "--vocab", "128",
         "--repeat", "1", "--chunk", "8", "--threads", "1"]


@pytest.mark.parametrize("extra,precision,rtol", [(["--precision", "fp32"], "fp32", 1e-5), ([], "trainer", 2e-2),
                                                   (["--dtype", "bfloat16"], "bf16", 2e-2)])
@pytest.mark.slow
def test_bench_step_variants_compute_the_same_loss(tmp_path, capsys, extra, precision, rtol):
    """The default is the trainer's precision (fp32 weights under bf16 autocast); fp32 also times
    the DFlash2 step next to the v1 step (its loss: another model's)."""
    out = tmp_path / "step.json"
    variants = ["--variants", "fast,reference,dflash2", "--conv-group-size", "8",
                "--selector-rank", "8"] if precision == "fp32" else []
    assert main(["bench", "step", *POINT, *extra, *variants, "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    if variants:
        assert rows["dflash2"]["ms_per_step"] > 0 and rows["dflash2"]["loss"] > 0
        assert "dflash2 / fast: time" in capsys.readouterr().out
    fast, reference = rows["fast"], rows["reference"]
    assert fast["precision"] == reference["precision"] == precision
    assert fast["autocast"] == reference["autocast"] == (precision == "trainer")
    assert fast["loss"] == pytest.approx(reference["loss"], rel=rtol)
    for row in (fast, reference):
        assert row["ms_per_step"] > 0 and row["peak_mib"] >= 0 and row["saved_mib"] > 0


def test_the_memory_fork_of_a_process_that_ran_parallel_ops_measures_and_returns():
    """On CPU each variant's memory is measured in a fork of the benchmark's process. A fork that
    enters the OpenMP pool of a parent which ran multi-threaded ops hangs (libgomp): the fork
    measures on one thread. An alarm turns a hang into a failure (the fork is killed on the way)."""
    import signal

    import torch

    from flashdraft.bench import step as bench

    def hung(signum, frame):
        raise TimeoutError("the memory fork did not answer within 60 s")

    threads, previous = torch.get_num_threads(), signal.signal(signal.SIGALRM, hung)
    try:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum().item()  # the parent's OpenMP pool is up
        signal.alarm(60)
        point = bench._point(bench_args(), 64, 8, 64, "fast")
        row = bench.run_point({**point, "repeat": 0})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_num_threads(threads)
    assert "error" not in row, row
    assert row["saved_mib"] > 0 and row["peak_mib"] >= 0 and row["memory_threads"] == 1 and row["threads"] == 2


def bench_args():
    """POINT's arguments, on 2 threads."""
    import argparse

    from flashdraft.bench import step as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([*POINT, "--threads", "2"])


def test_unknown_bench_step_variants_are_refused():
    with pytest.raises(ValueError, match="--variants"):
        main(["bench", "step", *POINT, "--variants", "fast,dflash3"])


@pytest.mark.parametrize("fail_on_call", [1, 3])
def test_a_variant_out_of_memory_while_timing_is_reported_and_the_other_still_timed(monkeypatch, fail_on_call):
    """All variants live in one process while timed (a GPU point can fit alone and not together):
    an OOM drops that variant with the error (or keeps the rounds it finished), not the run."""
    import torch

    from flashdraft.bench import step as bench

    real_step_fn = bench.step_fn

    def step_fn(point, *built):
        step, calls = real_step_fn(point, *built), [0]

        def failing():
            calls[0] += 1
            if calls[0] >= fail_on_call:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
            return step()

        return failing if point["variant"] == "reference" else step

    monkeypatch.setattr(bench, "step_fn", step_fn)
    args = dict(seq=64, anchors=8, hidden=64, layers=2, block=4, vocab=128, batch=1, taps=5, chunk=8,
                anchors_per_microbatch=0, checkpointing=False, attention="auto", repeat=3, threads=1,
                device="cpu", dtype="float32", autocast=False, head_dim=64, intermediate=192)
    fast, reference = bench.time_interleaved([{**args, "variant": v} for v in ("fast", "reference")])
    assert len(fast) == 3 and min(fast) > 0  # all rounds
    if fail_on_call == 1:  # the warm-up: nothing timed
        assert reference.startswith("out of memory while timing") and "9.00 GiB" in reference
    else:  # the second timed round: the first round's time stays
        assert len(reference) == 1 and reference[0] > 0


def test_a_benchmark_report_is_never_written_through_a_link_into_a_model(tmp_path):
    """`bench ... --json` writes its report as eval writes its own (flashdraft.outputs): a link to
    a file is refused before the benchmark runs (it used to be written through), a new path gets
    the report by a rename."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "report.json").symlink_to(tmp_path / "model" / "config.json")
    with pytest.raises(ValueError, match=r"--json .*report.json is a symbolic link \(to .*config.json\): a report is "
                                         r"written beside it and renamed into place"):
        main(["bench", "step", "--json", str(tmp_path / "report.json")])
    assert (tmp_path / "model" / "config.json").read_text() == "{}"


@pytest.mark.parametrize("variants", ["fast,reference", "fast,kd"])
def test_bench_step_with_soft_labels_agrees_with_the_reference_and_reads_against_ce(tmp_path, capsys, variants):
    """--kd-weight puts soft labels in every variant (the chunked head's KD equals the dense
    reference's); the kd variant is the fast step with them, reported against the CE step."""
    out = tmp_path / "step.json"
    kd = ["--kd-weight", "0.5"] if variants == "fast,reference" else []
    assert main(["bench", "step", *POINT, "--precision", "fp32", "--variants", variants, *kd, "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    if variants == "fast,reference":
        assert rows["fast"]["kd_weight"] == rows["reference"]["kd_weight"] == 0.5
        assert rows["fast"]["loss"] == pytest.approx(rows["reference"]["loss"], rel=1e-5)
    else:
        assert rows["fast"]["kd_weight"] == 0.0 and rows["kd"]["kd_weight"] == 0.5
        assert rows["kd"]["loss"] != rows["fast"]["loss"]
        assert "kd / fast: time" in capsys.readouterr().out


def test_soft_labels_keep_the_step_peak_memory_within_15_percent_of_ce():
    """Issue 40: the KD step's peak memory <= 1.15x the CE step's at the same point. At a point
    where the LM head's [chunk, V] logits are most of the step (a 64K vocabulary), the KD head's
    three buffers (the drafter's logits, the teacher's, p_T) take a third of the chunk's rows
    each, so its peak is the CE head's one buffer (before: four buffers of the whole chunk)."""
    from flashdraft.bench import step as bench

    args = bench_args()
    args.vocab, args.chunk, args.threads = 65536, 96, 1
    peaks = {}
    for variant in ("fast", "kd"):
        row = bench.run_point({**bench._point(args, 64, 16, 64, variant), "block": 8, "repeat": 0})
        assert "error" not in row, row
        peaks[variant] = row["peak_mib"]
    assert peaks["fast"] > 20  # the head's 96 x 65536 fp32 logits (24 MiB) are there
    assert peaks["kd"] <= 1.15 * peaks["fast"], peaks
