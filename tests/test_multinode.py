"""Start-up, steps and resume at scale (issue 29), on 2 gloo ranks: what a many-node job pays
per step and at start-up, and that a slow rank or a second node never breaks the run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import flashdraft.target as target_mod
from conftest import overrides, results, run_ranks


def test_each_step_votes_skip_and_stop_in_one_all_reduce(tiny_job, tmp_path, trainer_forkserver):
    """Between two optimizer steps a rank asks for two all-reduces: the loss normaliser (one
    number, read on the device) and the step's vote (two numbers: non-finite, stop; the one
    host sync). Before, the non-finite vote and the stop vote were an all-reduce each."""
    args = overrides(tiny_job, tmp_path / "run", train__max_steps=6, train__log_every=100)
    ranks = results(run_ranks(trainer_forkserver, "train_collectives", json.dumps(args), timeout=240))
    for r in ranks:
        assert len(r["per_step"]) == 6
        for step, ops in enumerate(r["per_step"][1:-1], start=2):  # the first holds start-up's, the last the log's
            assert ops == [["all_reduce", 1], ["all_reduce", 2]], f"step {step}: {ops}"


def test_a_rank_loading_slower_than_the_collective_timeout_still_trains(tiny_job, tmp_path, trainer_forkserver):
    """Rank 1 reads its target 8 s late, past train.collective_timeout_s=4: the ranks meet at the
    start-up barrier (train.startup_timeout_s) before DDP's first broadcast, and both train.
    Before the barrier, rank 0's broadcast failed after 4 s."""
    args = overrides(tiny_job, tmp_path / "run", train__max_steps=2, train__collective_timeout_s=4)
    ranks = results(run_ranks(trainer_forkserver, "train_slow_loader", json.dumps(args), "8", timeout=240))
    assert [(r["error"], r["steps"]) for r in ranks] == [(None, 2), (None, 2)]


def test_a_rank_later_than_the_startup_timeout_fails_the_job_with_a_named_error(tiny_job, tmp_path,
                                                                                  trainer_forkserver):
    args = overrides(tiny_job, tmp_path / "run", train__startup_timeout_s=2)
    ranks = results(run_ranks(trainer_forkserver, "train_slow_loader", json.dumps(args), "12", timeout=240))
    for r in ranks:
        assert r["error"] is not None and r["error"].startswith("StartupError: start-up barrier after loading"), r
        assert "train.startup_timeout_s=2 s" in r["error"]
    assert "1" in ranks[0]["error"].split("(", 1)[1]  # rank 0 names the missing rank


@pytest.mark.parametrize("flock", ["enosys", "per_node"])
def test_the_data_is_converted_by_rank_0_alone_whatever_the_filesystem_locks(tmp_path, forkserver, flock):
    """A parquet source opened by 2 ranks: rank 0 converts (3 s, past the 2 s collective
    timeout), rank 1 waits at the start-up barrier, both open the one shard. Before, the
    conversion was serialised by an flock: ENOSYS on Lustre failed every rank; per-node locks
    let both ranks convert, each replacing the shard under the other."""
    rows = [[i % 7 + 1] * (5 + i % 4) for i in range(24)]
    pq.write_table(pa.table({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]}), tmp_path / "train.parquet")
    marks = tmp_path / "marks"
    marks.mkdir()
    ranks = results(run_ranks(forkserver, "convert_once", str(tmp_path / "train.parquet"), str(marks), flock,
                              timeout=120))
    assert [(r["error"], r["samples"]) for r in ranks] == [(None, 24), (None, 24)]
    assert sorted(m.name for m in marks.iterdir()) == ["rank0"]


def test_a_failed_conversion_fails_every_rank_at_once(tmp_path, forkserver):
    """Rank 0's conversion raises (no loss_mask column): it still lets the others go, and they
    fail naming the missing shard instead of waiting for the start-up timeout (60 s)."""
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "bad.parquet")
    (tmp_path / "marks").mkdir()
    ranks = results(run_ranks(forkserver, "convert_once", str(tmp_path / "bad.parquet"), str(tmp_path / "marks"),
                              "per_node", timeout=50))
    assert "no column 'loss_mask'" in ranks[0]["error"]
    assert ranks[1]["error"].startswith("ValueError: ") and "no token shard after rank 0 converted" in ranks[1]["error"]


def test_the_target_is_loaded_straight_onto_its_device(tiny_job, monkeypatch):
    """transformers places each tensor on ``device_map`` as it reads it from the memory-mapped
    files; loading to the host and then moving made a whole host copy per local rank on a GPU
    node (with a cast, or once the pages were read). On CPU both paths read the same mapped
    pages (measured: 150 MB above the imports for a 520 MB fp32 target either way), so this
    checks the rule, not the RSS: the loader is told the device and nothing moves the model
    afterwards."""
    loads, moves, inside = [], [], [False]
    real_load, real_to = target_mod.AutoModelForCausalLM.from_pretrained, torch.nn.Module.to

    def load(*args, **kwargs):
        loads.append(kwargs.get("device_map"))
        inside[0] = True
        try:
            return real_load(*args, **kwargs)
        finally:
            inside[0] = False

    def to(module, *args, **kwargs):
        if not inside[0]:
            moves.append(type(module).__name__)
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(target_mod.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    target = target_mod.TargetModel.from_pretrained(tiny_job / "target", target_layer_ids=[1, 2], device="cpu")
    assert loads == [torch.device("cpu")] and moves == []
    assert all(p.device.type == "cpu" for p in target.model.parameters())
