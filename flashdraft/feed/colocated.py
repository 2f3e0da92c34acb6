"""The colocated placement: every rank runs the data and target stages of its own batch plan,
pipelined with its drafter step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashdraft.data.batching import BatchSampler
from flashdraft.feed.cache import CacheStats
from flashdraft.feed.flow import Pipeline
from flashdraft.feed.stages import FeatureStages
from flashdraft.feed.steps import Feed

if TYPE_CHECKING:
    from flashdraft.distributed import Dist


class ColocatedFeed(Feed):
    """This rank's own next ``num_steps`` steps: data (plan + collate into pooled pinned
    buffers) and target (H2D + frozen forward) stages, in a Pipeline whose consumer is the
    caller's loop (the drafter step, on this thread), with this run's feature cache open while
    it runs. pipeline.enabled=false, or a tensor-parallel target, runs the same stages inline:
    the sequential baseline, and for a sharded target the guarantee that the ranks of a group
    run the same forwards, one by one, and stop after the same one (a read-ahead forward one
    rank started and another did not would wait for it until the collective timeout;
    ``serve_features`` runs a sharded target inline for the same reason). Closing joins every
    thread, then closes the feature cache (its final counters: ``cache_stats``)."""

    def __init__(self, stages: FeatureStages, sampler: BatchSampler, num_steps: int, threaded: bool,
                 dist: Dist):
        """``threaded``: the stages run on threads of their own (feed.topology decides, and warms
        the target up first)."""
        pcfg = stages.pipeline
        pool = stages.buffer_pool()
        stages.open_cache(dist.is_main, dist.world_size)
        self.stages, self._final_cache = stages, None
        super().__init__(Pipeline(stages.step_inputs(sampler, pool, num_steps), [stages.target_stage()],
                                  capacity=pcfg.capacity, threaded=threaded, pools=[pool],
                                  join_timeout_s=pcfg.join_timeout_s), pool)

    def cache_stats(self) -> CacheStats | None:
        if self.stages.cache is not None:
            return self.stages.cache.stats()
        return self._final_cache

    def _release(self) -> None:
        self._final_cache = self.stages.close_cache()  # after the threads: none uses it any more
