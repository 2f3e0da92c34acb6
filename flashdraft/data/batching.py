"""The batch plan: length-bucketed token-budget batches, shuffled per (seed, epoch), split per rank.

Global plan for one epoch (``build_batches``): samples are sorted by length, ties broken by a
random permutation drawn from (seed, epoch); consecutive samples, longest first, are packed
greedily into batches whose padded size ``len(batch) * max_length_in_batch`` stays within the
token budget and whose count stays within ``max_batch_size``; then the batch order is shuffled
with the same generator. Every sample appears in exactly one batch. Because the sorted length
sequence is the same every epoch, so is the number of batches.

Rank split (``BatchSampler``): global batch ``g`` belongs to global step ``g // world_size`` and
goes to rank ``g % world_size``, so a step consumes ``world_size`` consecutive plan entries.
The remainder: when the batches left in an epoch are not a multiple of the world size, the
``r`` batches with the most samples are split (each part of a valid batch is a valid batch)
into exactly ``world_size`` smaller batches, which form the epoch's final step; every rank
therefore gets the same number of batches and no sample is lost. Only if those ``r`` batches
hold fewer than ``world_size`` samples together (e.g. every batch is a single long sample) are
the ``r`` smallest batches dropped -- counted in ``BatchSampler.dropped`` and logged with the
reason -- never silently.

Cursor: ``state_dict()`` is ``{"epoch", "consumed", ...}`` where ``consumed`` counts GLOBAL plan
entries of that epoch already trained on (a multiple of the world size it ran with). Resuming
with any world size rebuilds the same global plan and splits the remaining entries
``plan[consumed:]`` across the new ranks; nothing before the cursor is read again.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), 0x5EED]))


def build_batches(lengths, *, token_budget: int, max_batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The global batch plan for one epoch: a list of int64 arrays of sample indices.

    Contract: every index in [0, len(lengths)) appears exactly once; for each batch,
    ``len(batch) * lengths[batch].max() <= token_budget`` and ``len(batch) <= max_batch_size``;
    identical for identical (seed, epoch); batch order (and tie-breaking) differ across epochs.
    A sample longer than ``token_budget`` is a ValueError naming the fix.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if token_budget < 1 or max_batch_size < 1:
        raise ValueError(f"token_budget={token_budget}, max_batch_size={max_batch_size}: both must be >= 1")
    n = len(lengths)
    if n == 0:
        return []
    longest = int(lengths.argmax())
    if lengths[longest] > token_budget:
        raise ValueError(
            f"sample {longest} has {int(lengths[longest])} tokens, more than data.token_budget={token_budget}: "
            f"raise data.token_budget to at least {int(lengths[longest])} or lower data.max_length to "
            f"{token_budget} (samples are truncated to max_length)"
        )
    rng = _rng(seed, epoch)
    # Longest first, random among equal lengths: lexsort sorts by the last key first.
    order = np.lexsort((rng.permutation(n), -lengths))
    sorted_len = lengths[order]
    # Greedy packing: a batch starting at sorted position i has max length sorted_len[i] (longest
    # first), so it holds min(max_batch_size, token_budget // sorted_len[i]) samples. One O(1)
    # step per batch, not per sample.
    per_batch_cap = np.minimum(max_batch_size, token_budget // np.maximum(sorted_len, 1))
    bounds = [0]
    i = 0
    cap = per_batch_cap.tolist()  # one bulk conversion; indexing a list is cheaper than numpy scalars
    while i < n:
        i = min(n, i + cap[i])
        bounds.append(i)
    batches = np.split(order, bounds[1:-1])
    perm = rng.permutation(len(batches))
    return [batches[j] for j in perm]


def padding_waste(lengths, batches) -> float:
    """Share of padded tokens in the plan: 1 - real tokens / sum(len(batch) * longest in batch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = padded = 0
    for b in batches:
        lb = lengths[b]
        real += int(lb.sum())
        padded += len(b) * int(lb.max()) if len(b) else 0
    return 0.0 if padded == 0 else 1.0 - real / padded


def split_for_ranks(remaining: list[np.ndarray], world_size: int) -> tuple[list[np.ndarray], int]:
    """Make ``remaining`` a multiple of ``world_size`` long; returns (batches, samples dropped).

    With ``r = len % world_size``, the ``r`` batches holding the most samples are taken out and
    split into exactly ``world_size`` parts (largest part halved first) that form the final
    step. Choosing by sample count, not position, makes the outcome depend only on the multiset
    of batch sizes -- the same every epoch -- so every epoch has the same number of steps.
    If those batches hold fewer than ``world_size`` samples, the ``r`` batches with the FEWEST
    samples are dropped instead and their sample count returned.
    """
    r = len(remaining) % world_size
    if r == 0:
        return remaining, 0
    sizes = np.array([len(b) for b in remaining])
    by_size = np.argsort(-sizes, kind="stable")
    if int(sizes[by_size[:r]].sum()) < world_size:
        drop = set(by_size[-r:].tolist())
        return [b for j, b in enumerate(remaining) if j not in drop], int(sizes[by_size[-r:]].sum())
    take = set(by_size[:r].tolist())
    parts = [remaining[j] for j in sorted(take)]
    while len(parts) < world_size:
        k = max(range(len(parts)), key=lambda j: len(parts[j]))
        big = parts.pop(k)
        half = (len(big) + 1) // 2
        parts[k:k] = [big[:half], big[half:]]
    return [b for j, b in enumerate(remaining) if j not in take] + parts, 0


class BatchSampler:
    """This rank's batches, epoch after epoch: yields ``(epoch, step_in_epoch, indices)``.

    indices: int64 array of dataset indices for this rank's micro-batch of that global step.
    Every rank yields the same number of batches per epoch (``batches_per_epoch``). Iterates
    forever unless ``num_epochs`` is given. ``state_dict()`` after a yielded batch resumes right
    after it, with the same or a different ``world_size`` (see module docstring).
    """

    def __init__(self, lengths, *, token_budget: int, max_batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, num_epochs: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.token_budget, self.max_batch_size, self.seed = token_budget, max_batch_size, seed
        self.rank, self.world_size, self.num_epochs = rank, world_size, num_epochs
        self.epoch = 0
        self.consumed = 0  # global plan entries of self.epoch already yielded (all ranks)
        # How this epoch's consumed entries were consumed: [(entries, world_size)] per run segment.
        # The remainder rule reorders entries per world size, so resuming must rebuild that order.
        self._segments: list[tuple[int, int]] = []
        self.dropped: dict[int, int] = {}  # epoch -> samples dropped by the remainder rule
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None
        self._num_global = len(self._plan(0))

    def _plan(self, epoch: int) -> list[np.ndarray]:
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            plan = build_batches(self.lengths, token_budget=self.token_budget, max_batch_size=self.max_batch_size,
                                 seed=self.seed, epoch=epoch)
            self._plan_cache = (epoch, plan)
        return self._plan_cache[1]

    def _steps(self, epoch: int, consumed: int) -> list[list[np.ndarray]]:
        """Remaining global steps of ``epoch`` from cursor ``consumed``: lists of world_size batches.

        The entries already consumed are those the earlier run segments went through, in the
        order their own world size's remainder rule gave them (``_segments``); the rest is split
        for this world size.
        """
        ordered, pos = self._plan(epoch), 0
        for entries, world in self._segments:
            ordered = ordered[:pos] + split_for_ranks(ordered[pos:], world)[0]
            pos += entries
        if pos != consumed:
            raise ValueError(f"data cursor consumed={consumed} disagrees with its segments {self._segments}")
        remaining, dropped = split_for_ranks(ordered[consumed:], self.world_size)
        if dropped:
            self.dropped[epoch] = dropped
            log.warning("epoch %d: dropped %d samples -- the last batches held fewer samples than world_size=%d "
                        "ranks need for one step", epoch, dropped, self.world_size)
        w = self.world_size
        return [remaining[s : s + w] for s in range(0, len(remaining), w)]

    @property
    def batches_per_epoch(self) -> int:
        """Batches this rank gets in a full epoch (from cursor 0); the same on every rank and epoch."""
        r = self._num_global % self.world_size
        full = self._num_global // self.world_size
        if r == 0:
            return full
        sizes = np.sort([len(b) for b in self._plan(self.epoch)])[::-1]  # same multiset every epoch
        return full + (1 if sizes[:r].sum() >= self.world_size else 0)

    @property
    def num_global_batches(self) -> int:
        """Entries in the global plan of one epoch (before the remainder rule)."""
        return self._num_global

    def __iter__(self):
        while self.num_epochs is None or self.epoch < self.num_epochs:
            epoch, start, before = self.epoch, self.consumed, list(self._segments)
            steps = self._steps(epoch, start)
            for s, batches in enumerate(steps):
                last = s == len(steps) - 1
                # Advance the cursor before yielding, so state_dict() taken after this batch resumes after it.
                if last:
                    self.epoch, self.consumed, self._segments = epoch + 1, 0, []
                else:
                    self.consumed = start + (s + 1) * self.world_size
                    self._segments = before + [(self.consumed - start, self.world_size)]
                yield epoch, start // self.world_size + s, batches[self.rank]
            if not steps:
                self.epoch, self.consumed, self._segments = epoch + 1, 0, []

    def __len__(self) -> int:
        return self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "segments": [list(x) for x in self._segments],
                "seed": self.seed,
                "token_budget": self.token_budget, "max_batch_size": self.max_batch_size,
                "num_samples": len(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "token_budget", "max_batch_size", "num_samples"):
            mine = len(self.lengths) if key == "num_samples" else getattr(self, key)
            if key in state and state[key] != mine:
                raise ValueError(
                    f"data cursor was saved with {key}={state[key]} but this run has {mine}; the batch plan would "
                    f"differ, so the cursor cannot be resumed: restore {key}={state[key]} (or start a fresh run)"
                )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        if not 0 <= self.consumed <= self._num_global:
            raise ValueError(f"data cursor consumed={self.consumed} outside [0, {self._num_global}]")
        # Cursors without segments (older checkpoints) were made at this world size.
        segments = state.get("segments", [[self.consumed, self.world_size]] if self.consumed else [])
        self._segments = [(int(n), int(w)) for n, w in segments]
        if sum(n for n, _ in self._segments) != self.consumed:
            raise ValueError(f"data cursor consumed={self.consumed} disagrees with its segments {segments}")
