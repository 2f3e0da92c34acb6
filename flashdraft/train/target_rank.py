"""A disaggregated job's target rank: it serves features and trains nothing.

It starts as every rank does (flashdraft.train.startup: the same checks in the same order, the
target with its tensor / expert-parallel plan, the data), meets the drafter ranks at the
start-up barrier, then runs the feed's serve loop (flashdraft.feed.disaggregated) until its
drafter ranks have their steps or stop. The drafter, its optimizer, the checkpoints and the
validator are the drafter ranks' alone: none is built here.
"""

from __future__ import annotations

import functools
import signal

from flashdraft import feed
from flashdraft.config import Config
from flashdraft.distributed import Dist
from flashdraft.metrics import StageTimer
from flashdraft.signals import Stopped
from flashdraft.train import checks, startup
from flashdraft.train.runtime import GracefulStop


class TargetRank:
    """``TargetRank(config, dist)`` starts the rank (checks, target, data, the start-up
    barrier); ``serve()`` feeds its drafter ranks to the end of the run."""

    def __init__(self, config: Config, dist: Dist):
        cfg = startup.with_init_from(config)  # the drafter's shape: the data's block size
        self.config, self.dist = cfg, dist
        startup.check_run(cfg, dist)
        self.target = startup.load_target(cfg, dist)
        try:
            mask_token_id = checks.resolve_mask_token_id(cfg.drafter.mask_token_id, cfg.target.path)
            self.dataset = startup.open_data(cfg, dist, self.target, mask_token_id).dataset
            startup.meet()  # where the drafter ranks meet it, once they have built their parts
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End what the target holds beyond this process (an engine target's engine). Idempotent."""
        startup.close_target(self.target)

    def __enter__(self) -> TargetRank:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def serve(self) -> dict:
        """Serve the drafter ranks; returns ``{"steps": steps sent to each drafter rank,
        "stopped": False}``. Raises Stopped (128 + the signal) when the drafter ranks stopped
        early: a signal here or there ends the whole job."""
        # A SIGTERM / Ctrl-C is the drafter ranks' to act on (they checkpoint, then send STOP);
        # this rank passes it on and keeps serving until they do.
        with GracefulStop() as stop:
            result = feed.serve(self.config, self.dist, target=self.target, dataset=self.dataset,
                                plans=functools.partial(startup.batch_plan, self.config, self.dataset),
                                timer=StageTimer(self.dist.device, owner_only=True), stop=stop)
        if result["stopped"]:
            raise Stopped(stop.signum or signal.SIGTERM,
                          f"target rank {self.dist.global_rank} stopped after {result['steps']} steps (a "
                          "stop request); its drafter ranks saved the checkpoint")
        return result
