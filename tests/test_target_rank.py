"""A disaggregated target rank's start (train/target_rank.py), in this process: what it holds and
what it never builds, and its close(). Serving its drafter ranks needs the job (tests/test_feed_placement.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import overrides
from flashdraft.config import load_config
from flashdraft.distributed import Dist
from flashdraft.target import TargetModel
from flashdraft.train import startup
from flashdraft.train.target_rank import TargetRank

DISAGGREGATED = {"pipeline__placement": "disaggregated", "pipeline__target_ranks": 1}


def _target_rank_dist() -> Dist:
    """Rank 1 of a 2-rank job, its target rank, feeding drafter rank 0 (no process group: the
    start-up barrier is a no-op then)."""
    return Dist(rank=0, world_size=1, role="target", global_rank=1, peers=(0,), job_world_size=2,
                device=torch.device("cpu"))


def test_a_target_rank_holds_the_whole_target_and_the_data_and_builds_no_drafter(tiny_job, tmp_path):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", **DISAGGREGATED))
    with TargetRank(cfg, _target_rank_dist()) as rank:
        assert isinstance(rank.target, TargetModel) and not rank.target.heads_only
        assert rank.target.layer_ids == [1, 2] and len(rank.dataset) == 32
        assert set(vars(rank)) == {"config", "dist", "target", "dataset"}  # no drafter, optimizer, checkpoints
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_target_rank_closes_its_target_on_exit_and_when_its_start_fails(tiny_job, tmp_path, monkeypatch):
    cfg = load_config(overrides=overrides(tiny_job, tmp_path / "run", **DISAGGREGATED))
    closed = []
    real_close = startup.close_target
    monkeypatch.setattr(startup, "close_target", lambda target: (closed.append(target), real_close(target)))
    with TargetRank(cfg, _target_rank_dist()) as rank:
        pass
    assert closed == [rank.target]

    def broken(*args, **kwargs):
        raise RuntimeError("the data broke after the target loaded")

    monkeypatch.setattr(startup, "open_data", broken)
    with pytest.raises(RuntimeError, match="the data broke"):
        TargetRank(cfg, _target_rank_dist())
    assert len(closed) == 2 and isinstance(closed[1], TargetModel)
