"""The feature stages: what produces a training step's inputs, up to the target's features.

    data (plan + collate into pooled pinned buffers)  ->  h2d  ->  target forward (+ feature cache)

:class:`FeatureStages` holds what these stages share (the dataset, the frozen target, the
feature cache) and gives each stage as a plain
method; the placements (flashdraft.feed.colocated, flashdraft.feed.disaggregated) wire them
into a Pipeline (flashdraft.feed.flow), which owns the threads. Each stage runs exactly once per
micro-batch.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from flashdraft import distributed
from flashdraft.config import PipelineConfig
from flashdraft.data.batching import BatchSampler
from flashdraft.data.collate import CollateBuffers, pad_batch
from flashdraft.feed.cache import CacheStats, FeatureCache, full_cache_bytes
from flashdraft.feed.flow import BufferPool, Stage
from flashdraft.feed.steps import Micro, StepInput
from flashdraft.metrics import format_bytes

log = logging.getLogger(__name__)


class FeatureStages:
    """The data, h2d and target stages of one rank (see module doc)."""

    def __init__(self, pipeline: PipelineConfig, micro_batches: int, dataset, target, device: torch.device,
                 timer):
        """``pipeline``: the run's pipeline section (channel capacity, the feature cache's tiers);
        ``micro_batches``: a step's (train.grad_accum)."""
        self.pipeline, self.micro_batches = pipeline, micro_batches
        self.dataset, self.target, self.device, self.timer = dataset, target, device, timer
        self.cache: FeatureCache | None = None  # open while a colocated feed runs (open_cache / close_cache)

    def buffer_pool(self, extra_slots: int = 0) -> BufferPool:
        """Pooled collate buffers, one slot (``grad_accum`` micro-batches) per step that can be in
        flight: data filling + channel + target + channel + consumer when pipelined, else one;
        plus ``extra_slots`` (steps a consumer holds on to, e.g. sent but not yet received)."""
        pcfg = self.pipeline
        num_slots = (2 * pcfg.capacity + 3 if pcfg.enabled else 1) + extra_slots
        return BufferPool([[CollateBuffers() for _ in range(self.micro_batches)] for _ in range(num_slots)],
                          self.device)

    # ---- stage 1: data ------------------------------------------------------------------------

    def collate_step(self, batches, slot: list[CollateBuffers], sampler: BatchSampler) -> StepInput | None:
        """One step: the next ``grad_accum`` batches of the plan iterator ``batches`` padded into
        the pooled ``slot``, with ``sampler``'s cursor after them; fewer at the end of the plan
        (None when it has none left)."""
        micro = []
        for buffers in slot:
            found = next(batches, None)
            if found is None:
                break
            idx = found[2]
            micro.append(Micro(pad_batch(self.dataset, idx, buffers=buffers), idx))
        return StepInput(micro, slot, sampler.state_dict()) if micro else None

    def step_inputs(self, sampler: BatchSampler, pool: BufferPool, num_steps: int):
        """The data stage (data thread): plan + collate ``num_steps`` steps into pooled buffers."""
        batches = iter(sampler)
        for _ in range(num_steps):
            slot = pool.acquire()
            with self.timer.stage("data"):
                item = self.collate_step(batches, slot, sampler)
            if item is None:  # the plan ended (steps_left counts its steps: not expected)
                pool.release(slot)
                return
            yield item

    # ---- stage 2: h2d + target ---------------------------------------------------------------

    def h2d(self, item: StepInput) -> StepInput:
        """Copy the step's micro-batches to the device (non_blocking from pinned buffers), and
        look their samples up in the feature cache. Any thread."""
        with self.timer.stage("h2d"):
            for m in item.micro:
                m.device_batch = m.batch.to(self.device)
                m.device_ids = torch.from_numpy(m.sample_ids).to(self.device, non_blocking=True)
                if self.cache is not None:
                    m.cached = self.cache.lookup(m.sample_ids, m.batch.lengths, self.device)
        return item

    def forward(self, item: StepInput) -> StepInput:
        """The frozen target's packed features of each micro-batch. Any thread; a collective over
        the target group only when the target is tensor-parallel (then on the main thread:
        ColocatedFeed), never one over the job."""
        op = "tensor-parallel target forward (a rank of this target group died or hung)"
        for m in item.micro:
            with (self.target.lock, self.timer.stage("target"),
                  distributed.collective_errors(op, target_group=True)):
                if m.cached is not None:  # the cache's rows; the target runs on the rest, if any
                    m.features = self.cache.complete(m.cached, self.target, m.device_batch, m.sample_ids,
                                                     m.batch.lengths)
                    m.cached = None
                else:
                    m.features = self.target.features(m.device_batch.input_ids, m.device_batch.attention_mask)
        return item

    def target_stage(self) -> Stage:
        return Stage("target", self.forward, device=self.device, h2d=self.h2d)

    def warm_up(self) -> None:
        """One target forward on this thread before the target thread starts: kernel autotuning
        (Triton / flash-linear-attention autotuners are not thread-safe) and lazy init happen
        here, serially. Later forwards are also serialised by the target's ``lock``."""
        n = int(min(self.dataset.lengths.max(), 64))
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        with self.target.lock:
            self.target.features(ids, torch.ones_like(ids))

    # ---- the feature cache -----------------------------------------------------------------

    def open_cache(self, is_main: bool, world_size: int) -> None:
        """Open this run's target-feature cache (pipeline.feature_cache_*), when on. Always
        starts empty: it is an optimisation, never part of a checkpoint."""
        pcfg = self.pipeline
        if not pcfg.feature_cache_bytes and not pcfg.feature_cache_disk_bytes:
            return
        # The disk tier's default is node-local scratch ($TMPDIR, else /tmp): every rank streams
        # its own file there, which a shared output directory (NFS, Lustre) would carry for all.
        directory = Path(pcfg.feature_cache_dir) if pcfg.feature_cache_dir else \
            Path(tempfile.gettempdir()) / "flashdraft-feature-cache"
        self.cache = FeatureCache(feature_size=self.target.feature_size, dtype=self.target.dtype,
                                  ram_bytes=pcfg.feature_cache_bytes,
                                  disk_bytes=pcfg.feature_cache_disk_bytes,
                                  directory=directory, pin_memory=self.device.type == "cuda")
        if is_main:
            need = full_cache_bytes(int(self.dataset.lengths.sum()), self.cache.feature_size,
                                    self.cache.itemsize)
            log.info("feature cache: RAM %s + disk %s per rank; the features of every sample take %s (each "
                     "rank sees a different 1/%d of them every epoch; docs/pipeline.md)",
                     format_bytes(self.cache.ram_budget), format_bytes(self.cache.disk_budget),
                     format_bytes(need), world_size)

    def close_cache(self) -> CacheStats | None:
        """Close the cache (call once no stage thread uses it any more); returns its final
        counters (None: it was off)."""
        if self.cache is None:
            return None
        stats = self.cache.stats()
        self.cache.close()
        self.cache = None
        return stats
