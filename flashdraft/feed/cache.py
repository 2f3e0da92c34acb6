"""A byte-bounded cache of the frozen target's packed features, per sample, reused across epochs.

The target is frozen, so a sample's packed taps [len, K*H] are the same every epoch. With the
cache on, the target stage computes them once (epoch 1), keeps them (RAM, then disk), and in
later epochs reads them back instead of running the target: the target stage becomes a copy.

Storage: exactly what the drafter consumes, the tapped hidden states in the target's output
dtype, one entry per sample WITHOUT padding; a hit gives the very bits the target produced.
- RAM tier: a dict of CPU tensors, up to ``ram_bytes``.
- disk tier: one append-only scratch file per process, up to ``disk_bytes``, with an
  {sample id: (offset, length)} index; reads go straight into the destination rows
  (``os.preadv``), so the page cache serves repeated reads. The file is created unlinked
  (``tempfile.TemporaryFile``), so nothing is left behind even after ``kill -9``, and a new run
  always starts empty (the cache is an optimisation; checkpoints never hold it).

Policy: fill until full, never evict. Access is epoch-cyclic (every sample once per epoch, in
a fresh shuffled order): with LRU, once the working set exceeds the cache every entry is
evicted before its next use, so the hit rate falls to ~0; keeping the first entries that fit
gives hit rate = cache size / working set, the best any policy gets on a cyclic scan.

Transfers (on a GPU): a micro-batch's hit rows are read (by a few copy threads: memcpy and
``preadv`` release the GIL) into a pooled staging buffer, pinned, one H2D copy of it; only the
hit rows are written (the device copy's other rows and padding are zeroed on the device, one
masked fill). New samples leave the device in one non-blocking D2H copy into a pooled pinned
buffer with an event, and are stored once that event has completed (checked, never waited for,
at the next call). The pools are rings of a few grow-only buffers, so the pinned memory is a
few of the largest micro-batches, whatever the shapes an epoch brings (the pinned allocator
keeps every size it ever rounded to: a fresh buffer per micro-batch would keep them all).

Threading: one thread uses a cache (the trainer's target thread; the main thread when the
pipeline is sequential). ``stats()`` copies plain counters and may be read from any thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from flashdraft.feed.flow import HostWorkers, record_event
from flashdraft.metrics import format_bytes

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    """Counters since the cache was created (samples, micro-batches, bytes)."""

    hits: int = 0  # samples whose features came from the cache
    misses: int = 0  # samples the target computed
    skipped_forwards: int = 0  # micro-batches served entirely from the cache: no target forward
    partial_forwards: int = 0  # micro-batches where the target ran on the missing samples only
    entries: int = 0  # samples held
    ram_bytes: int = 0  # bytes held in RAM
    disk_bytes: int = 0  # bytes held on disk
    disk_full: bool = False  # the disk tier's file could not grow (a full disk): it holds no more since

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    def as_metrics(self, prefix: str = "cache/") -> dict[str, float]:
        return {**{f"{prefix}{k}": v for k, v in asdict(self).items()}, f"{prefix}hit_rate": self.hit_rate}

    def format(self) -> str:
        return (f"feature cache: {self.hits} hits / {self.misses} misses ({100 * self.hit_rate:.1f}%), "
                f"{self.skipped_forwards} target forwards skipped, {self.partial_forwards} partial; "
                f"{self.entries} samples held, {format_bytes(self.ram_bytes)} RAM + "
                f"{format_bytes(self.disk_bytes)} disk" + (" (the disk filled up)" if self.disk_full else ""))


class StagingRing:
    """A few reusable flat host buffers (pinned for a GPU), handed out in turn: the pooled
    staging of the cache's transfers. A buffer grows (by at least 1.5x) to the largest request
    it gets, then stays; one handed out again first waits for the event of its last transfer
    (a host wait only when ``size`` transfers are still in flight). ``allocations`` and
    ``nbytes`` count what the ring ever allocated and holds."""

    def __init__(self, size: int, pin_memory: bool):
        self.pin_memory = pin_memory
        self.size = size
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(size)]
        self._events: list = [None] * size
        self._next = 0
        self.allocations = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """(index, a flat uint8 view of ``nbytes``) of the next buffer, free to overwrite."""
        k = self._next
        self._next = (k + 1) % len(self._buffers)
        if self._events[k] is not None:
            self._events[k].synchronize()  # its transfer of ``size`` calls ago: long done in practice
            self._events[k] = None
        if self._buffers[k].numel() < nbytes:
            grown = max(nbytes, int(self._buffers[k].numel() * 1.5))
            self._buffers[k] = torch.empty(grown, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.allocations += 1
        return k, self._buffers[k][:nbytes]

    def busy_until(self, k: int, event) -> None:
        """Buffer ``k`` is read or written by a transfer that completes with ``event`` (None: done)."""
        self._events[k] = event

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)


@dataclass
class CacheLookup:
    """The cached part of one micro-batch: ``features`` [B, S, F] on the device with the hit
    rows filled (zeros elsewhere, padding included), or None when nothing hit."""

    hit_rows: list[int]
    miss_rows: list[int]
    features: torch.Tensor | None


class FeatureCache:
    """Per-sample packed target features keyed by the dataset's sample id (see the module doc).

    feature_size: K*H, the last dimension of the target's packed features.
    dtype: the target's output dtype; entries of another dtype are refused.
    ram_bytes / disk_bytes: budgets of the two tiers (0 disables a tier); never exceeded.
    directory: where the disk tier's scratch file lives (needed when disk_bytes > 0); a
    node-local disk (the trainer's default: the temporary directory, $TMPDIR).
    pin_memory: pinned staging buffers (for a GPU; None: when CUDA is available).
    staging / copy_threads: buffers per staging ring, threads that read hit rows.
    """

    def __init__(self, *, feature_size: int, dtype: torch.dtype, ram_bytes: int, disk_bytes: int = 0,
                 directory: str | os.PathLike | None = None, pin_memory: bool | None = None, staging: int = 4,
                 copy_threads: int = 4):
        if feature_size < 1 or ram_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"FeatureCache: feature_size={feature_size}, ram_bytes={ram_bytes}, "
                             f"disk_bytes={disk_bytes} are invalid; use a positive size and budgets >= 0")
        self.feature_size = feature_size
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.ram_budget = ram_bytes
        self.disk_budget = disk_bytes
        self._ram: dict[int, torch.Tensor] = {}
        self._disk: dict[int, tuple[int, int]] = {}  # sample id -> (byte offset, tokens)
        self._stats = CacheStats()
        self._file = None
        pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.h2d_staging = StagingRing(staging, pin)  # hit rows on their way to the device
        self.d2h_staging = StagingRing(staging, pin)  # new samples on their way to the cache
        self._stores: deque = deque()  # (event, ring index, host rows, [(sample id, tokens)]) in flight
        self._storing: set[int] = set()  # sample ids in ``_stores``: room reserved, not readable yet
        self._reserved = {"ram": 0, "disk": 0}  # bytes of ``_stores`` per tier, counted until stored
        self._copiers = HostWorkers(copy_threads) if copy_threads > 1 else None
        self.directory = Path(directory) if directory is not None else None
        if disk_bytes:
            if directory is None:
                raise ValueError("FeatureCache: disk_bytes > 0 needs a directory for the scratch file")
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
                self._file = tempfile.TemporaryFile(dir=directory, prefix="features-", buffering=0)
                free = shutil.disk_usage(directory).free
            except OSError as exc:
                raise ValueError(
                    f"pipeline.feature_cache_dir={directory}: cannot create the disk tier's scratch file ({exc}); "
                    "point it at a writable local disk, or set pipeline.feature_cache_disk_bytes=0") from None
            if free < disk_bytes:  # the budget the disk can hold now, not the one asked for (said, not silent)
                log.warning("feature cache: pipeline.feature_cache_disk_bytes=%d (%s) but %s has %s free: the disk "
                            "tier holds at most that; free disk space there, or lower the budget",
                            disk_bytes, format_bytes(disk_bytes), directory, format_bytes(free))
                self.disk_budget = free

    # ---- entries ------------------------------------------------------------------------------

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._ram or sample_id in self._disk

    def __len__(self) -> int:
        return len(self._ram) + len(self._disk)

    def put(self, sample_id: int, features_LF: torch.Tensor) -> bool:
        """Keep a copy of one sample's features [len, F] (any device); False when no tier has
        room (nothing is evicted) or the sample is held already."""
        sample_id = int(sample_id)
        if features_LF.dim() != 2 or features_LF.shape[1] != self.feature_size or features_LF.dtype != self.dtype:
            raise ValueError(f"FeatureCache.put: sample {sample_id} has features {tuple(features_LF.shape)} "
                             f"{features_LF.dtype}; expected [len, {self.feature_size}] {self.dtype}")
        nbytes = features_LF.numel() * self.itemsize
        if sample_id in self or sample_id in self._storing or not self.has_room(nbytes):
            return False
        return self._keep(sample_id, features_LF.to("cpu", copy=True).contiguous(), self._tier(nbytes))

    def _keep(self, sample_id: int, host: torch.Tensor, tier: str) -> bool:
        """Store ``host`` (a CPU tensor of its own) in ``tier``, which has room for it."""
        nbytes = host.numel() * self.itemsize
        if tier == "ram":
            self._ram[sample_id] = host
            self._stats.ram_bytes += nbytes
        else:
            offset = self._stats.disk_bytes
            if not self._write(host, offset):
                return False
            self._disk[sample_id] = (offset, host.shape[0])
            self._stats.disk_bytes += nbytes
        self._stats.entries += 1
        return True

    def has_room(self, nbytes: int) -> bool:
        """Whether a tier has room for ``nbytes`` more, beyond the samples still on their way in."""
        return self._tier(nbytes) is not None

    def _tier(self, nbytes: int) -> str | None:
        """The first tier with room for ``nbytes`` more (RAM, then disk), or None."""
        if self._stats.ram_bytes + self._reserved["ram"] + nbytes <= self.ram_budget:
            return "ram"
        if self._file is not None and self._stats.disk_bytes + self._reserved["disk"] + nbytes <= self.disk_budget:
            return "disk"
        return None

    def read_into(self, sample_id: int, out_LF: torch.Tensor) -> None:
        """Copy sample ``sample_id``'s features into ``out_LF`` (a contiguous CPU [len, F] view)."""
        if sample_id in self._ram:
            entry = self._ram[sample_id]
            if entry.shape != out_LF.shape:
                raise RuntimeError(f"feature cache: sample {sample_id} holds {tuple(entry.shape)}, "
                                   f"asked for {tuple(out_LF.shape)}")
            out_LF.copy_(entry)
            return
        offset, tokens = self._disk[sample_id]
        if (tokens, self.feature_size) != tuple(out_LF.shape):
            raise RuntimeError(f"feature cache: sample {sample_id} holds {tokens} tokens, asked for {out_LF.shape[0]}")
        view = _bytes_of(out_LF)
        got = os.preadv(self._file.fileno(), [view], offset)
        if got != view.nbytes:
            raise OSError(f"feature cache: short read of sample {sample_id} from the scratch file "
                          f"({got} of {view.nbytes} bytes at offset {offset})")

    def get(self, sample_id: int) -> torch.Tensor:
        """A copy of one sample's features [len, F] on the CPU (KeyError when not held)."""
        if sample_id in self._ram:
            return self._ram[sample_id].clone()
        _, tokens = self._disk[sample_id]
        out = torch.empty(tokens, self.feature_size, dtype=self.dtype)
        self.read_into(sample_id, out)
        return out

    def _write(self, host: torch.Tensor, offset: int) -> bool:
        """Append at ``offset``; on a full disk, stop using the disk tier (False) instead of failing."""
        data = _bytes_of(host)
        try:
            done = 0
            while done < data.nbytes:
                done += os.pwrite(self._file.fileno(), data[done:], offset + done)
        except OSError as exc:  # e.g. ENOSPC: the cache is an optimisation; the run goes on without more entries
            log.warning("feature cache: the disk tier's scratch file in %s could not grow past %s of its %s budget "
                        "(%s): it holds no more samples, and later epochs run the target for those it does not "
                        "hold; free disk space there, or lower pipeline.feature_cache_disk_bytes", self.directory,
                        format_bytes(self._stats.disk_bytes), format_bytes(self.disk_budget),
                        exc.strerror or exc)
            self.disk_budget = self._stats.disk_bytes
            self._stats.disk_full = True
            return False
        return True

    # ---- micro-batches --------------------------------------------------------------------------

    def lookup(self, sample_ids: np.ndarray, lengths: torch.Tensor, device: torch.device) -> CacheLookup:
        """Host-to-device part: the cached rows of a micro-batch, padded [B, S, F] on ``device``
        (zeros outside the hit rows), from a pooled staging buffer: only the hit rows are
        written there, then one non_blocking copy (pinned, on a GPU; on the caller's current
        stream) and one masked fill on the device."""
        self._store_completed()
        ids = [int(i) for i in sample_ids]
        hit_rows = [r for r, i in enumerate(ids) if i in self]
        miss_rows = [r for r, i in enumerate(ids) if i not in self]
        self._stats.hits += len(hit_rows)
        self._stats.misses += len(miss_rows)
        if not hit_rows:
            return CacheLookup(hit_rows, miss_rows, None)
        lengths = lengths.tolist()  # a host tensor: no device sync
        shape = (len(ids), max(lengths), self.feature_size)
        k, flat = self.h2d_staging.take(int(np.prod(shape)) * self.itemsize)
        staged = flat.view(self.dtype).view(shape)
        self._map(lambda r: self.read_into(ids[r], staged[r, : lengths[r]]), hit_rows)
        features = staged.to(device, non_blocking=True, copy=True)  # its own tensor, even on the CPU
        self.h2d_staging.busy_until(k, record_event(device))
        keep = torch.zeros(shape[:2], dtype=torch.bool)  # [B, S]: the hit rows' real tokens
        for r in hit_rows:
            keep[r, : lengths[r]] = True
        features.masked_fill_(~keep.to(device, non_blocking=True)[..., None], 0)  # stale staging bytes elsewhere
        return CacheLookup(hit_rows, miss_rows, features)

    def _map(self, fn, rows: list[int]) -> None:
        if self._copiers is None or len(rows) < 2:
            for r in rows:
                fn(r)
        else:
            self._copiers.run(fn, rows)  # re-raises a row's error

    def complete(self, found: CacheLookup, target, batch, sample_ids: np.ndarray,
                 lengths: torch.Tensor) -> torch.Tensor:
        """Target part: the micro-batch's packed features [B, S, F] on the target's device.

        No miss: the cached rows, no target forward. No hit: the target on the whole batch,
        exactly as without a cache. Otherwise the target runs on the missing rows only
        (trimmed to their longest). New samples are kept while the budget lasts: one
        non-blocking copy to the host, stored once it has completed (no sync in the calling,
        target, thread). batch: the device Batch; lengths: its host lengths [B]."""
        if not found.miss_rows:
            self._stats.skipped_forwards += 1
            return found.features
        if not found.hit_rows:
            features = target.features(batch.input_ids, batch.attention_mask)
        else:
            self._stats.partial_forwards += 1
            rows = torch.tensor(found.miss_rows, device=batch.input_ids.device)
            s = int(lengths[found.miss_rows].max())
            features = found.features
            features[rows, :s] = target.features(batch.input_ids[rows, :s], batch.attention_mask[rows, :s])
        self._store_rows(features, found.miss_rows, sample_ids, lengths.tolist())
        return features

    def _store_rows(self, features: torch.Tensor, rows: list[int], sample_ids: np.ndarray, lengths: list[int]) -> None:
        """Start keeping rows ``rows`` of ``features`` [B, S, F] (any device): the ones the
        budget has room for, packed on their device, one non_blocking copy into a pooled
        staging buffer, stored by ``_store_completed`` once its event has completed."""
        keep = []  # (row, sample id, tier): the tiers fill in row order, as put() one by one would
        for r in rows:
            sample_id, size = int(sample_ids[r]), lengths[r] * self.feature_size * self.itemsize
            tier = None if sample_id in self or sample_id in self._storing else self._tier(size)
            if tier is not None:
                keep.append((r, sample_id, tier))
                self._reserved[tier] += size
        if not keep:
            return
        while len(self._stores) >= self.d2h_staging.size:  # every staging buffer holds a copy not yet stored
            if self._stores[0][0] is not None:
                self._stores[0][0].synchronize()  # rare: the oldest is ``size`` micro-batches old
            self._store_completed()
        packed = torch.cat([features[r, : lengths[r]] for r, _, _ in keep])  # [tokens, F] on the device
        k, flat = self.d2h_staging.take(packed.numel() * self.itemsize)
        host = flat.view(self.dtype).view(packed.shape)
        host.copy_(packed, non_blocking=True)
        event = record_event(features.device)
        self.d2h_staging.busy_until(k, event)
        self._stores.append((event, host, [(sample_id, lengths[r], tier) for r, sample_id, tier in keep]))
        self._storing.update(sample_id for _, sample_id, _ in keep)
        self._store_completed()

    def _store_completed(self) -> None:
        """Store the samples whose copy to the host has completed (``query``: never a wait);
        the copies are stored in order, so the first one still running ends the scan."""
        while self._stores and (self._stores[0][0] is None or self._stores[0][0].query()):
            _, host, entries = self._stores.popleft()
            offset = 0
            for sample_id, tokens, tier in entries:
                self._storing.discard(sample_id)
                self._reserved[tier] -= tokens * self.feature_size * self.itemsize
                self._keep(sample_id, host[offset : offset + tokens].clone(), tier)  # out of the reused buffer
                offset += tokens

    # ---- lifetime -------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        return CacheStats(**asdict(self._stats))

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging rings (pinned on a GPU)."""
        return self.h2d_staging.nbytes + self.d2h_staging.nbytes

    def close(self) -> None:
        """Drop every entry, the copies in flight and the scratch file (idempotent)."""
        self._ram.clear()
        self._disk.clear()
        self._stores.clear()
        self._storing.clear()
        self._reserved = {"ram": 0, "disk": 0}
        if self._copiers is not None:
            self._copiers.close()
            self._copiers = None
        if self._file is not None:
            self._file.close()  # unlinked already: its space is freed now
            self._file = None


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a writable uint8 array (bf16 has no numpy dtype)."""
    return t.view(torch.uint8).numpy().reshape(-1)


def full_cache_bytes(num_tokens: int, feature_size: int, dtype_bytes: int) -> int:
    """Bytes a cache of every sample needs: tokens x K*H x bytes per value (no padding kept)."""
    return num_tokens * feature_size * dtype_bytes
