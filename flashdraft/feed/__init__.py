"""The feature producer: everything that makes a training step's inputs, up to the frozen
target's features, behind one object the trainer iterates (``Feed``).

    __init__.py       open_feed / serve: the builders that pick a rank's placement
    topology.py       Topology: threading, warm-up and the link's step header, decided once per job
    steps.py          StepInput / Micro (what a step consumes) and Feed (items, done, metrics, report, close)
    stages.py         FeatureStages: data -> h2d -> target forward (+ feature cache)
    cache.py          the byte-bounded cache of target features reused across epochs
    colocated.py      ColocatedFeed: each rank runs its own stages
    disaggregated.py  DrafterFeed (a drafter rank receives) and serve_features (a target rank's loop)
    wire.py           the feature links' messages: kinds, the step header, HELLO, dtypes
    flow.py           the engine: threads, bounded channels, CUDA streams and events, buffer pools

This face is all the trainer sees (tests/test_architecture.py): ``open_feed``, ``serve``, ``Feed``,
what a Feed yields and what it reports. Nothing here imports flashdraft.train. The builders are
the one place here that reads the whole run config: each part below takes its sections' values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashdraft.config import Config
from flashdraft.feed.cache import CacheStats
from flashdraft.feed.colocated import ColocatedFeed
from flashdraft.feed.disaggregated import DrafterFeed, Plans, serve_features
from flashdraft.feed.flow import PipelineReport
from flashdraft.feed.stages import FeatureStages
from flashdraft.feed.steps import Feed, ListFeed, Micro, StepInput
from flashdraft.feed.topology import Topology
from flashdraft.feed.wire import Header

if TYPE_CHECKING:
    from flashdraft.data.batching import BatchSampler
    from flashdraft.distributed import Dist

__all__ = ["CacheStats", "Feed", "ListFeed", "Micro", "PipelineReport", "StepInput", "open_feed", "serve"]


def open_feed(config: Config, dist: Dist, *, target, dataset, sampler: BatchSampler, start_step: int,
              total_steps: int, timer, stop) -> Feed:
    """A training rank's Feed of the steps ``start_step`` .. ``total_steps``: its own data and target
    stages (colocated), or the link to its target rank (a disaggregated drafter rank, whose
    ``target`` holds the embedding and head only). ``sampler``: this rank's batch plan, at the
    resumed cursor; ``timer``: the main thread's StageTimer; ``stop``: the run's GracefulStop."""
    topology = Topology.of(config.pipeline, _header(config), dist)
    if dist.role == "drafter":
        return DrafterFeed(topology.header, dist, timer, sampler, start_step, total_steps, stop)
    stages = FeatureStages(config.pipeline, config.train.grad_accum, dataset, target, dist.device, timer)
    topology.prepare(stages, total_steps - start_step)
    return ColocatedFeed(stages, sampler, total_steps - start_step, topology.threaded, dist)


def serve(config: Config, dist: Dist, *, target, dataset, plans: Plans, timer, stop) -> dict:
    """A disaggregated target rank's whole run: serve its drafter ranks their steps (the result
    of ``serve_features``); ``plans(rank, world_size)``: the batch plan of the drafter rank a
    HELLO names, as that rank's trainer builds it."""
    stages = FeatureStages(config.pipeline, config.train.grad_accum, dataset, target, dist.device, timer)
    return serve_features(stages, dist, Topology.of(config.pipeline, _header(config), dist), plans, stop,
                          log_every=config.train.log_every)


def _header(config: Config) -> Header:
    """A step's header on a disaggregated link: both ends derive it from the same config."""
    return Header(config.train.grad_accum, config.data.max_batch_size)
