"""`flashdraft inspect` and `flashdraft bench data` run end to end on small real datasets."""

import json

import datasets
import numpy as np

from flashdraft.cli import main
from flashdraft.data.bench import lognormal_lengths, make_hf_dataset


def test_inspect_seed_style_dataset(tmp_path, capsys):
    make_hf_dataset(tmp_path / "hf", 300, 100, 1000, 32_000)
    assert datasets.load_from_disk(str(tmp_path / "hf")).features["input_ids"].feature.dtype == "int64"
    assert main(["inspect", str(tmp_path / "hf"), "--vocab-size", "32000", "--max-length", "512"]) == 0
    out = capsys.readouterr().out
    for needle in ("samples         300 kept of 300", "supervised", "p50", "padding waste", "problems        none", "ready in"):
        assert needle in out


def test_inspect_json_reports_problems(tmp_path, capsys):
    make_hf_dataset(tmp_path / "hf", 200, 100, 1000, 32_000)
    assert main(["inspect", str(tmp_path / "hf"), "--vocab-size", "16000", "--json"]) == 0
    out = capsys.readouterr().out
    s = json.loads(out[out.index("{"):])
    assert s["samples_seen"] == 200 and s["dropped"]["id_out_of_range"] > 0
    assert s["samples"] + sum(s["dropped"].values()) == 200
    assert "re-tokenize" not in json.dumps(s["examples"])  # examples name samples; the fix is printed separately
    assert all(e.startswith("sample ") for e in s["examples"]["id_out_of_range"])


def test_bench_data_small(tmp_path, capsys):
    code = main(["bench", "data", "--samples", "3000", "--mean-length", "128", "--max-length", "2048",
                 "--naive-subset", "200", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "| Measure | Seed data path | flashdraft | Ratio |" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["flashdraft"]["samples"] == 3000 and r["seed"]["preload_subset"] == 200


def test_lognormal_lengths_long_tailed():
    x = lognormal_lengths(100_000, 256, 8192)
    assert 200 < x.mean() < 300 and np.percentile(x, 99) > 4 * np.median(x) and x.min() >= 64
