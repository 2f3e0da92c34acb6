"""The prepared GPU checks run on CPU at toy sizes: a session that gets a GPU for 15 minutes must
not spend them on a script that a renamed config field or flag has broken."""

import json
import os
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # end to end: every GPU script at toy sizes on CPU


def run(cmd: list[str], out, **env_vars) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(out), **env_vars}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_gpu_checks_script_smoke(tmp_path):
    """benchmarks/gpu_checks.sh (gpu_step.sh + `bench gpu-pipeline`, each under its own time limit)
    with SMOKE=1: the scripts' own flags, then CPU / toy overrides."""
    # on 2 shared CPU cores the sharded check's process launches need more than its GPU limit
    proc = run(["bash", "benchmarks/gpu_checks.sh"], tmp_path, SMOKE="1", SHARDED_TIMEOUT="200")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "device none" in (tmp_path / "env.txt").read_text()

    step = (tmp_path / "gpu_step.txt").read_text()
    assert "fast ms_per_step=" in step and "reference ms_per_step=" in step
    assert "% of peak" in step  # the achieved share of the device's peak is reported
    assert {r["variant"] for r in json.loads((tmp_path / "gpu_step.json").read_text())} == {"fast", "reference"}

    swa = json.loads((tmp_path / "gpu_swa.json").read_text())
    assert [(r["variant"], r["sliding_window"], r["weighting"]) for r in swa] == [("fast", 1024, "dpace"),
                                                                                 ("dflash2", 1024, "dpace")]
    assert "dflash2 / fast: time" in (tmp_path / "gpu_swa.txt").read_text()

    sharded = (tmp_path / "gpu_sharded.txt").read_text()
    assert "ngram" in sharded and sharded.count(": PASS") == 1, sharded  # SMOKE: 2 gloo CPU ranks, the baseline

    result = json.loads((tmp_path / "gpu_pipeline.json").read_text())
    for mode in ("sequential", "pipelined"):
        assert result[mode]["steps_per_s"] > 0 and result[mode]["pipeline"]["bound"].endswith("-bound")
        assert len(result[mode]["losses"]) == 3  # logged every 2 of 6 steps
    assert result["max_loss_diff"] == 0.0  # CPU: the pipeline changes timing, not results


def test_gpu_multi_script_smoke(tmp_path):
    """benchmarks/gpu_multi.sh with SMOKE=1 (2 gloo CPU ranks): the disaggregated run's 5 steps,
    DDP with a checkpoint and an exact resume, the per-process context check (no CUDA here:
    none), each reported PASS. The sharded eval is left out: test_gpu_checks_script_smoke runs
    gpu_sharded.sh already."""
    proc = run(["bash", "benchmarks/gpu_multi.sh"], tmp_path, SMOKE="1", MULTI_SHARDED="0", MULTI_TIMEOUT="400")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "disaggregated: final checkpoint at step 5, expected 5: PASS" in out
    assert "resumed (resumed) vs ddp (uninterrupted), step 6 vs 6: max |diff| 0" in out
    assert "CUDA contexts, 6 processes, each on its own GPU only: PASS" in out
    assert out.rstrip().endswith("multi-GPU check: PASS")
