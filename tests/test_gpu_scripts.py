"""The prepared GPU checks run on CPU at toy sizes: a session that gets a GPU for 15 minutes must
not spend them on a script that a renamed config field or flag has broken."""

import json
import os
import subprocess
import sys

from conftest import REPO


def run(cmd: list[str], out) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(out)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_gpu_pipeline_script_smoke(tmp_path):
    proc = run([sys.executable, "benchmarks/gpu_pipeline.py", "--smoke"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_pipeline.json").read_text())
    for mode in ("sequential", "pipelined"):
        assert result[mode]["steps_per_s"] > 0 and result[mode]["pipeline"]["bound"].endswith("-bound")
        assert len(result[mode]["losses"]) == 3  # logged every 2 of 6 steps
    assert result["max_loss_diff"] == 0.0  # CPU: the pipeline changes timing, not results


def test_gpu_step_script_smoke(tmp_path):
    # The script's own flags, then CPU / toy overrides (argparse keeps the last value of each).
    toy = ["--device", "cpu", "--dtype", "float32", "--seq", "64", "--anchors", "4", "--hidden", "128",
           "--head-dim", "64", "--intermediate", "256", "--layers", "1", "--taps", "2", "--vocab", "512",
           "--chunk", "16", "--repeat", "1"]
    proc = run(["bash", "benchmarks/gpu_step.sh", *toy], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fast ms_per_step=" in proc.stdout and "reference ms_per_step=" in proc.stdout
    assert "% of peak" in proc.stdout  # the achieved share of the device's peak is reported
