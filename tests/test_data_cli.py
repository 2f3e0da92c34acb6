"""`flashdraft inspect` and `flashdraft bench data` run end to end on small real datasets."""

import json

import datasets
import numpy as np

from flashdraft.bench.data import lognormal_lengths, make_hf_dataset
from flashdraft.cli import main


def test_inspect_seed_style_dataset(tmp_path, capsys):
    make_hf_dataset(tmp_path / "hf", 300, 100, 1000, 32_000)
    assert datasets.load_from_disk(str(tmp_path / "hf")).features["input_ids"].feature.dtype == "int64"
    assert main(["inspect", str(tmp_path / "hf"), "--vocab-size", "32000", "--max-length", "512"]) == 0
    out = capsys.readouterr().out
    for needle in ("samples         300 kept of 300", "supervised", "p50", "padding waste", "problems        none",
                   "ready in"):
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


def test_bench_data_pieces(tmp_path, capsys):
    # The benchmark's probes run in-process here (the real run starts fresh interpreters, whose
    # torch imports alone would dominate the test suite's time).
    from flashdraft.bench import data as bench
    from flashdraft.data.dataset import open_dataset

    make_hf_dataset(tmp_path / "hf", 3000, 128, 2048, 151_936)
    shard = open_dataset(tmp_path / "hf", cache_dir=tmp_path / "cache", progress=False).path
    params = dict(shard=str(shard), hf=str(tmp_path / "hf"), cache=str(tmp_path / "cache"), vocab_size=151_936,
                  max_length=2048, token_budget=4096, max_batch_size=64, min_supervised=32, subset=100)
    figures = {}
    for name, code in (("flashdraft", bench._FLASHDRAFT_PROBE), ("seed", bench._NAIVE_PROBE)):
        exec(code, {"PARAMS": params})
        out = capsys.readouterr().out
        figures[name] = json.loads(out.strip().splitlines()[-1])
    assert figures["flashdraft"]["samples"] == 3000 and figures["seed"]["preload_subset"] == 100
    results = {"args": {"max_length": 2048, "vocab_size": 151_936, "token_budget": 4096, "max_batch_size": 64},
               "python_start_s": 0.02, "convert_s": 1.0, "machine": bench.machine(), **figures}
    table = bench.format_table(results)
    assert "| Measure | Seed data path | flashdraft | Ratio |" in table and "Time to ready" in table


def test_bench_dispatcher_help(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "data", "--help"])
    assert exit_.value.code == 0 and "--mean-length" in capsys.readouterr().out


def test_every_bench_entry_parses_its_options(capsys):
    """Each registry entry names an importable module whose add_arguments builds its parser."""
    import pytest

    from flashdraft.bench import SUBBENCHES

    assert set(SUBBENCHES) == {"data", "prepare", "step", "train", "pipeline", "soak", "gpu-pipeline", "gpu-check",
                               "plan", "engine-features"}
    for name in SUBBENCHES:
        with pytest.raises(SystemExit) as exit_:
            main(["bench", name, "--help"])
        assert exit_.value.code == 0 and f"flashdraft bench {name}" in capsys.readouterr().out


def test_lognormal_lengths_long_tailed():
    x = lognormal_lengths(100_000, 256, 8192)
    assert 200 < x.mean() < 300 and np.percentile(x, 99) > 4 * np.median(x) and x.min() >= 64


def test_inspect_on_an_empty_dataset_says_so_and_fails(tmp_path, capsys):
    from flashdraft.cli import main
    from flashdraft.data.shards import write_token_shard

    write_token_shard(tmp_path / "empty", [], vocab_size=10)
    assert main(["inspect", str(tmp_path / "empty")]) == 1
    out = capsys.readouterr().out
    assert "the dataset has no samples" in out and "problems        none" not in out
