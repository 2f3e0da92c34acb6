"""What the trainer consumes: each optimizer step's inputs, and the :class:`Feed` that delivers
them (the one object the trainer sees of the feature producer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from flashdraft.data.collate import Batch, CollateBuffers
from flashdraft.feed.flow import BufferPool, Pipeline

if TYPE_CHECKING:
    from flashdraft.feed.cache import CacheLookup, CacheStats
    from flashdraft.feed.flow import PipelineReport


@dataclass
class Micro:
    """One micro-batch on its way through the stages. Iterates as ``(batch, sample_ids)``.

    batch / sample_ids: host data (``batch`` is a view of a pooled CollateBuffers slot).
    device_batch / device_ids: filled by the h2d stage, features by the target stage (on a
    disaggregated drafter rank, all three arrive from its target rank).
    cached: the feature cache's rows of this micro-batch (h2d part), when the cache is on.
    """

    batch: Batch
    sample_ids: np.ndarray
    device_batch: Batch | None = None
    device_ids: torch.Tensor | None = None
    features: torch.Tensor | None = None
    cached: CacheLookup | None = None

    def __iter__(self):
        return iter((self.batch, self.sample_ids))


@dataclass
class StepInput:
    """What the data stage produces per optimizer step: ``grad_accum`` micro-batches, the
    pooled buffer slot they live in, and the data cursor right after them (for checkpoints
    taken while the data thread is already ahead)."""

    micro: list[Micro]
    slot: list[CollateBuffers]
    sampler_state: dict


class Feed:
    """One rank's step inputs, made by its placement (``ColocatedFeed``, ``DrafterFeed``)::

        with feed:
            for item in feed:             # a StepInput, its tensors ready on this thread's stream
                train(item)
                feed.done(item)           # its pooled slot may be refilled
                log(feed.window_metrics(), feed.cache_stats())
        feed.report                       # the whole run's PipelineReport (+ the cache's counters)

    Iterate it on the thread that made it (the only thread that runs collectives). ``close``
    (also on ``with`` exit) ends the placement's own protocol (told whether the consumer failed),
    joins every thread the feed started, and keeps the whole run's report, failed or not.
    """

    def __init__(self, pipe: Pipeline, pool: BufferPool):
        self.pipe, self.pool = pipe, pool
        self.report: PipelineReport | None = None  # set by close

    def __iter__(self) -> Feed:
        return self

    def __next__(self) -> StepInput:
        """The next step's inputs; re-raises a stage's exception."""
        return next(self.pipe)

    def done(self, item: StepInput) -> None:
        """The consumer is done with ``item``: its pooled slot goes back (on CUDA behind an event
        on this thread's current stream, so it is refilled only after the work queued on it)."""
        self.pool.release(item.slot)

    def window_metrics(self) -> dict:
        """``pipe/*``: each stage's busy / starved / blocked ms per item since the previous call,
        and the bound. Never waits for the GPU."""
        return self.pipe.report().as_metrics()

    def cache_stats(self) -> CacheStats | None:
        """This rank's feature-cache counters since the start, final once closed (None: no cache)."""
        return None

    def close(self, error: BaseException | None = None) -> None:
        """End the feed (idempotent); ``error``: the consumer's, if it failed."""
        if self.report is not None:
            return
        try:
            self._finish(error)
        finally:
            self.pipe.close()
            self._release()
            self.report = self.pipe.report(window=False)  # the whole run's stage split
            stats = self.cache_stats()
            if stats is not None:
                self.report.notes.append(stats.format())

    def _finish(self, error: BaseException | None) -> None:
        """Before the pipeline closes: end the placement's own protocol (none here)."""

    def _release(self) -> None:
        """Once the pipeline's threads have ended: free what they used (nothing here)."""

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


class ListFeed(Feed):
    """A Feed of given step inputs whose micro-batches already hold their device tensors and
    features (``device_batch``, ``device_ids``, ``features``): no target, no thread. The loop and
    the step can be driven by it in a test, and it is the Feed protocol at its simplest."""

    def __init__(self, items: list[StepInput], device: torch.device | str = "cpu"):
        pool = BufferPool([item.slot for item in items], device)
        super().__init__(Pipeline(self._items(items, pool), [], threaded=False, pools=[pool]), pool)

    @staticmethod
    def _items(items: list[StepInput], pool):
        for item in items:
            pool.acquire()  # each item's slot goes back with done(): the source paces like a placement's
            yield item
