"""The decisions every feed of a job shares, made once from the pipeline section, the step's
header and the process (``Topology.of``; flashdraft.feed.open_feed / serve hand them down): the
placement, whether the stages run on threads (``pipeline.enabled``, never for a tensor-parallel
target, whose ranks must run the same forwards one by one), whether the target is warmed up
first, and the step header a disaggregated link carries. The placements
(flashdraft.feed.colocated, .disaggregated) only wire their stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashdraft.config import PipelineConfig
from flashdraft.feed.wire import Header

if TYPE_CHECKING:
    from flashdraft.distributed import Dist
    from flashdraft.feed.stages import FeatureStages


@dataclass(frozen=True)
class Topology:
    """What every feed of a job shares (see module doc)."""

    placement: str  # "colocated" or "disaggregated" (pipeline.placement)
    threaded: bool  # the data and target stages run on threads of their own
    header: Header  # a step's header on a disaggregated link

    @classmethod
    def of(cls, pipeline: PipelineConfig, header: Header, dist: Dist) -> Topology:
        # A sharded target's ranks must run the same forwards and stop after the same one: inline
        # (a read-ahead forward one rank started and another did not would wait for the timeout).
        return cls(pipeline.placement, pipeline.enabled and dist.tensor_size == 1, header)

    def prepare(self, stages: FeatureStages, num_steps: int) -> None:
        """Before the stages' threads start: one target forward on this thread (kernel autotuning
        and lazy init serially; Triton / flash-linear-attention autotuners are not thread-safe)."""
        if self.threaded and num_steps > 0:
            stages.warm_up()
