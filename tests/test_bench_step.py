"""`flashdraft bench step` runs both variants on the same weights and inputs: their losses agree
(fp32, and under bf16 autocast as the trainer runs on CUDA), and it reports time and memory."""

from __future__ import annotations

import json

import pytest

from flashdraft.cli import main

POINT = ["--seq", "64", "--hidden", "64", "--layers", "2", "--anchors", "8", "--block", "4", "--vocab", "128",
         "--repeat", "1", "--chunk", "8", "--threads", "1"]


@pytest.mark.parametrize("extra,rtol", [([], 1e-5), (["--dtype", "bfloat16", "--autocast"], 2e-2)])
def test_bench_step_variants_compute_the_same_loss(tmp_path, extra, rtol):
    out = tmp_path / "step.json"
    assert main(["bench", "step", *POINT, *extra, "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    fast, reference = rows["fast"], rows["reference"]
    assert fast["autocast"] == reference["autocast"] == bool(extra)
    assert fast["loss"] == pytest.approx(reference["loss"], rel=rtol)
    for row in (fast, reference):
        assert row["ms_per_step"] > 0 and row["peak_mib"] >= 0
