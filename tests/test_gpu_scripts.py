"""The prepared GPU checks run on CPU at toy sizes: a session that gets a GPU for 15 minutes must
not spend them on a script that a renamed config field or flag has broken."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

pytestmark = pytest.mark.slow  # end to end: every GPU script at toy sizes on CPU


def run(cmd: list[str], out, **env_vars) -> subprocess.CompletedProcess:
    """``cmd`` in the repository with OUT=``out``; the scripts' `python` is this interpreter (its
    virtualenv need not be activated)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(out), **env_vars,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


PARTS = ("prepare", "trainer_1024", "trainer_3072", "block_mask", "sinks", "deterministic", "graphs", "pipeline",
         "flex_compile")
IN_ONE_PROCESS = [part for part in PARTS if part != "deterministic"]  # deterministic: through the script below
VERDICT = re.compile(r"^gpu_checks: (PASS|FAIL|INCOMPLETE): .*$", re.M)


def _verdict(stdout: str) -> str:
    """The script's one verdict line (it must have exactly one, and end with it)."""
    found = VERDICT.findall(stdout)
    assert len(found) == 1 and stdout.rstrip().splitlines()[-1].startswith("gpu_checks: "), stdout[-3000:]
    return stdout.rstrip().splitlines()[-1]


def test_the_script_runs_every_part_with_a_time_limit():
    """gpu_checks.sh's parts and their limits name exactly gpu_check's parts, in order, then
    gpu_multi: the smoke tests run the script on a few parts only, so a misspelt part there is
    caught here."""
    from flashdraft.bench.gpu_check import PARTS as MODULE_PARTS

    script = (REPO / "benchmarks/gpu_checks.sh").read_text()
    limits = re.search(r"^limits=\(([^)]*)\)", script, re.M).group(1).split()
    every = re.search(r'^every="([^"]*)"', script, re.M).group(1).split()
    assert [entry.split(":")[0] for entry in limits] == list(MODULE_PARTS) == list(PARTS) == every[:-1]
    assert every[-1] == "gpu_multi"
    assert all(int(entry.split(":")[1]) > 0 for entry in limits)


def test_gpu_check_parts_smoke(tmp_path):
    """The parts of benchmarks/gpu_checks.sh on CPU at toy sizes in one process (the script starts
    one per part: the next test runs it): each part's JSON written, passing, the trainer parts
    compared with the memory plan of their own micro-batch; flex_compile's forward matches the
    dense oracle and its backward, which torch cannot run on CPU, is a skip that says so, so the
    exit status is 3 (nothing failed, not everything ran), never 0."""
    proc = run([sys.executable, "-m", "flashdraft.bench.gpu_check", *IN_ONE_PROCESS, "--job", str(tmp_path / "job"),
                "--out", str(tmp_path), "--smoke"], tmp_path)
    results = {part: json.loads((tmp_path / f"{part}.json").read_text()) for part in IN_ONE_PROCESS}
    for part, result in results.items():
        assert result["ok"] is True, (part, result)
        assert result["status"] == ("skip" if part == "flex_compile" else "pass"), (part, result)
        if part.startswith("trainer_"):
            assert result["losses"] and result["drafter_inputs"], result  # the trainer ran
            assert result["same_micro_batch"] and result["plan_micro_batch"][1] == result["seq"], result
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert "flex_compile: SKIP" in proc.stdout and "backward does not run on CPU" in results["flex_compile"]["skipped"]
    assert results["flex_compile"]["worst_error"] < 0.02 and len(results["flex_compile"]["calls"]) == 4
    assert results["block_mask"]["equal"] and max(results["sinks"]["errors"].values()) < 0.02
    assert results["pipeline"]["bit_equal"]
    assert results["graphs"]["distinct_lengths"] >= 2 and results["graphs"]["compiled_graphs"] == 0  # CPU: none


def test_gpu_checks_script_smoke(tmp_path):
    """benchmarks/gpu_checks.sh with SMOKE=1 on the deterministic part: the environment line, the
    prepare part it needs run first (each in its own process), both JSON passing, the two runs
    in two processes bit-equal; the verdict INCOMPLETE (exit 3), naming every part not run."""
    proc = run(["bash", "benchmarks/gpu_checks.sh"], tmp_path, SMOKE="1", PARTS="deterministic")
    assert "device none" in (tmp_path / "env.txt").read_text()
    results = {part: json.loads((tmp_path / f"{part}.json").read_text()) for part in ("prepare", "deterministic")}
    assert all(result["status"] == "pass" for result in results.values()), results
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["deterministic.json", "prepare.json"]
    assert proc.returncode == 3, proc.stdout[-3000:]
    verdict = _verdict(proc.stdout)
    assert verdict.startswith("gpu_checks: INCOMPLETE: ") and "passed: prepare, deterministic;" in verdict
    not_run = [p for p in PARTS if p not in ("prepare", "deterministic")]
    assert all(f"{part} (not asked for: PARTS=deterministic)" in verdict for part in not_run), verdict
    assert "gpu_multi (not asked for: PARTS=deterministic)" in verdict
    assert results["deterministic"]["weights_equal"] and results["deterministic"]["processes"] == 2


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="2+ GPUs here: the multi-GPU parts run")
def test_with_fewer_than_two_gpus_the_multi_gpu_parts_are_skips_named_in_the_verdict(tmp_path):
    """A 1-GPU (here 0-GPU) machine, not SMOKE: gpu_multi.sh and gpu_sharded.sh check nothing, so
    each says SKIP and exits 3 (they exited 0 as "skipped"), and gpu_checks.sh's verdict names
    each multi-GPU part among its skips; no line of any says PASS."""
    gpus = torch.cuda.device_count()
    sharded = run(["bash", "benchmarks/gpu_sharded.sh"], tmp_path)
    assert sharded.returncode == 3 and sharded.stdout.strip() == (
        f"sharded-target check: SKIP: sharded_eval needs 2 GPUs, {gpus} here"), sharded.stdout
    proc = run(["bash", "benchmarks/gpu_checks.sh"], tmp_path, PARTS="gpu_multi")
    assert proc.returncode == 3, proc.stdout[-3000:]
    verdict = _verdict(proc.stdout)
    assert verdict.startswith("gpu_checks: INCOMPLETE: ") and "passed:" not in verdict
    assert f"gpu_multi (disaggregated, ddp_resume, contexts, sharded_eval need 2 GPUs, {gpus} here)" in verdict
    assert "PASS" not in proc.stdout


def test_a_part_that_times_out_loses_only_its_own_json(tmp_path):
    """A part past its limit gets a JSON that says so; the script fails, naming it, and the other
    parts' JSON stands."""
    script = (REPO / "benchmarks/gpu_checks.sh").read_text().replace("sinks:30", "sinks:1")
    (tmp_path / "checks.sh").write_text(script.replace('cd "$(dirname "$0")/.."', f"cd {REPO}"))
    proc = run(["bash", str(tmp_path / "checks.sh")], tmp_path, SMOKE="1", PARTS="block_mask sinks",
               TIME_SCALE="1")
    assert proc.returncode == 1
    assert json.loads((tmp_path / "sinks.json").read_text()) == {"part": "sinks", "ok": False, "status": "fail",
                                                                 "error": "timed out after 1 s"}
    assert json.loads((tmp_path / "block_mask.json").read_text())["ok"] is True
    assert not (tmp_path / "prepare.json").exists()  # not needed by these parts
    assert _verdict(proc.stdout).startswith("gpu_checks: FAIL: failed sinks; passed: block_mask; SKIPPED: ")


def test_gpu_step_script_smoke(tmp_path):
    """benchmarks/gpu_step.sh (the drafter step benchmark; no longer part of the check) with CPU / toy flags."""
    proc = run(["bash", "benchmarks/gpu_step.sh", "--json", str(tmp_path / "gpu_step.json"), "--device", "cpu",
                "--dtype", "float32", "--seq", "64", "--anchors", "4", "--hidden", "128", "--head-dim", "64",
                "--intermediate", "256", "--layers", "1", "--taps", "2", "--vocab", "512", "--chunk", "16",
                "--repeat", "1"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fast ms_per_step=" in proc.stdout and "% of peak" in proc.stdout
    assert {r["variant"] for r in json.loads((tmp_path / "gpu_step.json").read_text())} == {"fast", "reference"}


def test_gpu_sharded_script_smoke(tmp_path):
    """benchmarks/gpu_sharded.sh (2 GPUs; the multi-GPU checks are wired elsewhere) on 2 gloo CPU ranks."""
    proc = run(["bash", "benchmarks/gpu_sharded.sh"], tmp_path, SMOKE="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ngram" in proc.stdout and proc.stdout.count(": PASS") == 1, proc.stdout


def test_gpu_multi_script_smoke(tmp_path):
    """benchmarks/gpu_multi.sh with SMOKE=1 (2 gloo CPU ranks): the disaggregated run's 5 steps,
    DDP with a checkpoint and an exact resume, the per-process context check (no CUDA here:
    none), each reported PASS. The sharded eval is left out (test_gpu_sharded_script_smoke runs
    it): the verdict names it as skipped, exit 3."""
    proc = run(["bash", "benchmarks/gpu_multi.sh"], tmp_path, SMOKE="1", MULTI_SHARDED="0", MULTI_TIMEOUT="400")
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]  # the sharded eval did not run
    out = proc.stdout
    assert "disaggregated: final checkpoint at step 5, expected 5: PASS" in out
    assert "resumed (resumed) vs ddp (uninterrupted), step 6 vs 6: max |diff| 0" in out
    assert "CUDA contexts, 6 processes, each on its own GPU only: PASS" in out
    assert out.rstrip().endswith("multi-GPU check: INCOMPLETE: SKIP: sharded_eval (MULTI_SHARDED=0)")
