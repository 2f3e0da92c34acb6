"""The batch plan: length-bucketed token-budget batches, shuffled per (seed, epoch), split per rank.

Global plan for one epoch (``build_batches``): samples are sorted by length, ties broken by a
random permutation drawn from (seed, epoch); consecutive samples, longest first, are packed
greedily into batches whose padded size ``len(batch) * max_length_in_batch`` stays within the
token budget, whose count stays within ``max_batch_size`` and, given a ``DrafterRows``, whose
drafter rows stay within its row budget; then the batch order is shuffled with the same
generator. Every sample appears in exactly one batch. Because the sorted length sequence is the
same every epoch, so is the number of batches.

Rank split (``BatchSampler``): global batch ``g`` belongs to global step ``g // world_size`` and
goes to rank ``g % world_size``, so a step consumes ``world_size`` consecutive plan entries.
The remainder: when the batches left in an epoch are not a multiple of the world size, the
last few plan entries are cut into contiguous groups of at most ``world_size`` entries and each
group is split (each part of a valid batch is a valid batch) into exactly ``world_size``
smaller batches (``plan_steps``). Every rank therefore gets the same number of batches,
ceil(global batches / world_size), and no sample is lost. Only in degenerate data, where
almost every batch is a single sample, are the last ``r`` entries dropped -- counted in
``BatchSampler.dropped`` and logged with the reason -- never silently.

Cursor: ``state_dict()`` holds ``epoch``, ``consumed`` (GLOBAL plan entries of that epoch
already trained on; every step consumes whole entries) and ``step``, plus the segment the
epoch's steps were cut from (``segment_start``, ``segment_world_size``), and what the plan is
built from (``PLAN_KEYS``: seed, budgets, sample count; a cursor saved under others is refused).
Resuming with the same world size rebuilds the same steps and skips the consumed ones -- the
remaining batches are identical. Resuming with a different world size starts a new segment at
``consumed`` and splits the remaining entries ``plan[consumed:]`` across the new ranks. Nothing
before the cursor is read again.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), 0x5EED]))


def anchor_slots(lengths, num_anchors: int):
    """The anchor axis of a padded micro-batch whose longest sample has ``lengths`` tokens (an int
    or an int array, one per micro-batch or per sample): max(1, min(num_anchors, length - 1)).

    A sequence of length L has at most L - 1 positions eligible as anchors (an anchor needs a
    next position: a + 1 < L), so it can supply no more; the objective's ``sample_anchors`` draws
    exactly this many anchors per sequence (invalid padding ones after a sequence's real ones),
    and the batch plan counts the same number: what the plan assumes is what the step computes.
    """
    return np.maximum(1, np.minimum(num_anchors, np.asarray(lengths, dtype=np.int64) - 1))


@dataclass(frozen=True)
class DrafterRows:
    """The drafter's work budget of a micro-batch: its rows, anchors x block_size per sequence.

    The drafter's cost (activations, FLOPs) grows with its rows, not with the target's tokens: a
    micro-batch of B sequences padded to S tokens computes B x ``anchor_slots(S, num_anchors)``
    anchored blocks of ``block_size`` rows each (padding anchors included, as the token budget
    counts padding tokens). The batch plan keeps that within ``budget``.
    """

    budget: int  # data.row_budget
    num_anchors: int  # objective.num_anchors
    block_size: int  # drafter.block_size

    def __post_init__(self):
        if min(self.budget, self.num_anchors, self.block_size) < 1:
            raise ValueError(f"{self}: the row budget, num_anchors and block_size must all be >= 1")

    def per_sequence(self, lengths):
        """Drafter rows of one sequence of each length in ``lengths`` (also: of every sequence of a
        micro-batch padded to that length)."""
        return anchor_slots(lengths, self.num_anchors) * self.block_size


def build_batches(lengths, *, token_budget: int, max_batch_size: int, seed: int, epoch: int,
                  rows: DrafterRows | None = None) -> list[np.ndarray]:
    """The global batch plan for one epoch: a list of int64 arrays of sample indices.

    Contract: every index in [0, len(lengths)) appears exactly once; for each batch,
    ``len(batch) * lengths[batch].max() <= token_budget``, ``len(batch) <= max_batch_size`` and,
    given ``rows``, ``len(batch) * rows.per_sequence(lengths[batch].max()) <= rows.budget``;
    identical for identical (seed, epoch); batch order (and tie-breaking) differ across epochs.
    Where ``rows`` does not bind, the plan is the one without it. A sample longer than
    ``token_budget``, or needing more drafter rows than ``rows.budget``, is a ValueError naming the fix.
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
            f"sample {longest} has {int(lengths[longest])} tokens, more than "
            f"data.token_budget={token_budget}: "
            f"raise data.token_budget to at least {int(lengths[longest])} or lower data.max_length to "
            f"{token_budget} (samples are truncated to max_length)"
        )
    if rows is not None:
        check_row_budget(int(lengths[longest]), rows, f"sample {longest}")
    rng = _rng(seed, epoch)
    # Longest first, random among equal lengths. Two stable sorts on 16-bit keys (numpy radix-
    # sorts those in O(n)): first by a random key, then by length -- 8x faster than lexsort
    # with a permutation for 1M samples. Lengths over 65,535 take the general path.
    random_key = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    order = np.argsort(random_key, kind="stable")
    if lengths.max() <= 65535:
        length_key = (np.uint16(65535) - lengths.astype(np.uint16))[order]
    else:
        length_key = -lengths[order]
    order = order[np.argsort(length_key, kind="stable")]
    # Greedy packing: a batch starting at sorted position i has max length lengths[order[i]]
    # (longest first), so it holds min(max_batch_size, token_budget // that) samples -- and at
    # most row budget // that length's rows: one O(1) step per batch (~20K for 1M samples),
    # nothing per sample.
    bounds = [0]
    i = 0
    while i < n:
        i = min(n, i + batch_capacity(int(lengths[order[i]]), token_budget, max_batch_size, rows))
        bounds.append(i)
    batches = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]  # views; np.split is 3x slower
    return [batches[j] for j in rng.permutation(len(batches))]


def batch_capacity(length: int, token_budget: int, max_batch_size: int,
                   rows: DrafterRows | None = None) -> int:
    """How many samples a micro-batch whose longest sample has ``length`` tokens holds: the rule
    ``build_batches`` packs by (and the memory plan sizes its worst micro-batch by)."""
    length = max(int(length), 1)
    fit = min(max_batch_size, token_budget // length)
    if rows is not None:
        fit = min(fit, rows.budget // int(rows.per_sequence(length)))
    return fit


def check_row_budget(length: int, rows: DrafterRows, what: str) -> None:
    """Refuse a sequence of ``length`` tokens whose own drafter rows exceed the row budget (it
    fits no micro-batch), naming the fixes."""
    need = int(rows.per_sequence(length))
    if need > rows.budget:
        fits = rows.budget // rows.block_size  # anchors whose blocks the budget holds
        other = (f" or lower objective.num_anchors to {fits}" if fits else
                 f" (one anchor's block alone is drafter.block_size={rows.block_size} rows: "
                 "no num_anchors fits)")
        raise ValueError(
            f"{what} has {length} tokens: min(objective.num_anchors={rows.num_anchors}, {length} - 1) "
            f"anchors x drafter.block_size={rows.block_size} = {need} drafter rows, more than "
            f"data.row_budget={rows.budget}: raise data.row_budget to at least {need}{other}"
        )


def padding_waste(lengths, batches) -> float:
    """Share of padded tokens in the plan: 1 - real tokens / sum(len(batch) * longest in batch)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = padded = 0
    for b in batches:
        lb = lengths[b]
        real += int(lb.sum())
        padded += len(b) * int(lb.max()) if len(b) else 0
    return 0.0 if padded == 0 else 1.0 - real / padded


def budget_fill(lengths, batches, token_budget: int) -> float:
    """Real tokens / (number of batches * token_budget): how full the plan keeps each step.

    Padding waste measures tokens lost inside batches; this measures steps lost to batches
    that cannot reach the budget (max_batch_size caps short samples; budget // length rounds
    down for long ones). 1 / fill is the most that packing several samples per row could save.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    return 0.0 if not batches else float(lengths.sum()) / (len(batches) * token_budget)


def plan_steps(remaining: list[np.ndarray],
               world_size: int) -> tuple[list[tuple[int, list[np.ndarray]]], int]:
    """Group plan entries into global steps of exactly ``world_size`` batches.

    Returns ``(steps, dropped)``: each step is ``(entries, batches)`` -- it consumes the next
    ``entries`` plan entries (contiguous, in order) and gives ``batches[rank]`` to each rank.
    Full steps take ``world_size`` entries as they are. When ``r = len % world_size`` is not 0,
    the last ``r + m * world_size`` entries (smallest m that works, m < 16) are cut into
    ``m + 1`` contiguous groups of at most ``world_size`` entries holding at least
    ``world_size`` samples each, and each group is split into exactly ``world_size`` batches
    (halving the largest part; a part of a valid batch is valid). Only if no m works (almost
    every batch is a single sample) are the last ``r`` entries dropped; ``dropped`` is their
    sample count.
    """
    n, w = len(remaining), world_size
    r = n % w
    full = [(w, remaining[i : i + w]) for i in range(0, n - r, w)]
    if r == 0:
        return full, 0
    sizes = np.array([len(b) for b in remaining], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for m in range(min(_MAX_TAIL_STEPS, (n - r) // w + 1)):
        start = n - (r + m * w)
        groups = _tail_groups(prefix, start, n, m + 1, w)
        if groups is not None:
            tail, a = [], start
            for e in groups:
                tail.append((e, _split_into(remaining[a : a + e], w)))
                a += e
            return full[: start // w] + tail, 0
    return full, int(sizes[n - r :].sum())


_MAX_TAIL_STEPS = 16  # tails longer than this many steps are not searched (only degenerate data needs them)


def _tail_groups(prefix: list[int], start: int, end: int, groups: int, w: int) -> tuple[int, ...] | None:
    """Entries per group cutting [start, end) into ``groups`` contiguous groups of at most ``w``
    entries holding at least ``w`` samples each (so each splits into ``w`` batches), or None."""

    @functools.cache
    def solve(p: int, g: int):
        left = end - p
        if g == 0:
            return () if left == 0 else None
        if left < g or left > g * w:
            return None
        for e in range(1, min(w, left) + 1):
            if prefix[p + e] - prefix[p] >= w:
                rest = solve(p + e, g - 1)
                if rest is not None:
                    return (e,) + rest
        return None

    return solve(start, groups)


def _split_into(batches: list[np.ndarray], parts: int) -> list[np.ndarray]:
    out = list(batches)
    while len(out) < parts:
        k = max(range(len(out)), key=lambda j: len(out[j]))
        big = out.pop(k)
        half = (len(big) + 1) // 2
        out[k:k] = [big[:half], big[half:]]
    return out


class BatchSampler:
    """This rank's batches, epoch after epoch: yields ``(epoch, step_in_epoch, indices)``.

    indices: int64 array of dataset indices for this rank's micro-batch of that global step.
    Every rank yields the same number of batches in an epoch. Iterates forever unless
    ``num_epochs`` is given. ``state_dict()`` taken after a yielded batch resumes right after
    it, with the same world size (exactly the same remaining batches) or a different one (the
    remaining plan entries re-split; see the module docstring).
    """

    def __init__(self, lengths, *, token_budget: int, max_batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, num_epochs: int | None = None, rows: DrafterRows | None = None):
        """``rows``: the drafter's row budget per micro-batch (None: rows unbounded)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.token_budget, self.max_batch_size, self.seed, self.rows = (
            token_budget, max_batch_size, seed, rows)
        self.rank, self.world_size, self.num_epochs = rank, world_size, num_epochs
        # Cursor (global, identical on every rank): epoch, plan entries consumed, steps done, and
        # the segment -- where in the plan, and with which world size, this epoch's steps were cut.
        self.epoch = self.consumed = self.step = self.segment_start = 0
        self.segment_world_size = world_size
        self.dropped: dict[int, int] = {}  # epoch -> samples dropped by the remainder rule
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None
        self._num_global = len(self._plan(0))

    def _build(self, epoch: int) -> list[np.ndarray]:
        return build_batches(self.lengths, token_budget=self.token_budget, max_batch_size=self.max_batch_size,
                             seed=self.seed, epoch=epoch, rows=self.rows)

    def _plan(self, epoch: int) -> list[np.ndarray]:
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            plan = self._build(epoch)
            self._plan_cache = (epoch, plan)
        return self._plan_cache[1]

    def _segment_steps(self, epoch: int) -> list[tuple[int, list[np.ndarray]]]:
        steps, dropped = plan_steps(self._plan(epoch)[self.segment_start :], self.world_size)
        if dropped and epoch not in self.dropped:
            self.dropped[epoch] = dropped
            log.warning("epoch %d: dropped %d samples: the last batches hold too few samples to split across "
                        "world_size=%d ranks (each batch holds ~1 sample; raise data.token_budget)",
                        epoch, dropped, self.world_size)
        return steps

    @property
    def batches_per_epoch(self) -> int:
        """Batches this rank gets in the current epoch from its start (the same on every rank).

        ceil(global batches / world_size), and the same every epoch, unless the remainder rule
        had to drop samples (then logged and counted in ``dropped``).
        """
        return len(plan_steps(self._plan(self.epoch), self.world_size)[0])

    def batches_left(self, num_epochs: int) -> int:
        """Batches each rank still gets from the cursor to the end of epoch ``num_epochs - 1``, at
        this world size: the current epoch's remaining entries (re-split if the world size
        changed), then each later epoch's own count -- planned, not assumed equal, since the
        remainder rule may drop samples in one epoch's shuffle and not another's. The same on
        every rank."""
        if self.epoch >= num_epochs:
            return 0
        start = self.consumed if self.segment_world_size != self.world_size else self.segment_start
        steps, _ = plan_steps(self._plan(self.epoch)[start:], self.world_size)
        pos, done = start, 0
        while pos < self.consumed and done < len(steps):
            pos += steps[done][0]
            done += 1
        later = 0
        for epoch in range(self.epoch + 1, num_epochs):  # not via _plan: its cache holds the current epoch
            plan = self._build(epoch)
            later += len(plan_steps(plan, self.world_size)[0])
        return len(steps) - done + later

    @property
    def num_global_batches(self) -> int:
        """Entries in the global plan of one epoch (the same every epoch)."""
        return self._num_global

    def __iter__(self):
        while self.num_epochs is None or self.epoch < self.num_epochs:
            epoch = self.epoch
            if self.segment_world_size != self.world_size:  # resumed with another world size
                self.segment_start, self.segment_world_size = self.consumed, self.world_size
            steps = self._segment_steps(epoch)
            pos, k = self.segment_start, 0
            while pos < self.consumed and k < len(steps):  # skip the steps already done (no data touched)
                pos += steps[k][0]
                k += 1
            if pos != self.consumed:
                raise ValueError(f"data cursor consumed={self.consumed} does not fall on a step boundary of "
                                 f"epoch {epoch}'s plan; the cursor does not belong to this data / plan")
            for i in range(k, len(steps)):
                entries, batches = steps[i]
                step = self.step
                # Advance the cursor before yielding: state_dict() taken now resumes after this batch.
                if i == len(steps) - 1:
                    self.epoch, self.consumed, self.step, self.segment_start = epoch + 1, 0, 0, 0
                else:
                    self.consumed, self.step = self.consumed + entries, self.step + 1
                yield epoch, step, batches[self.rank]
            if not steps or self.epoch == epoch:
                self.epoch, self.consumed, self.step, self.segment_start = epoch + 1, 0, 0, 0

    def _check_unbounded_cursor(self, epoch: int) -> None:
        """A cursor saved before the row budget existed (rows unbounded) resumes only where the
        budget does not bind, i.e. the plan is the one it was saved from."""
        unbounded = build_batches(self.lengths, token_budget=self.token_budget,
                                  max_batch_size=self.max_batch_size, seed=self.seed, epoch=epoch)
        planned = self._plan(epoch)
        if len(unbounded) != len(planned) or not all(np.array_equal(a, b)
                                                     for a, b in zip(unbounded, planned)):
            need = max(len(b) * int(self.rows.per_sequence(self.lengths[b].max())) for b in unbounded)
            raise ValueError(
                f"data cursor was saved without a drafter row budget, and data.row_budget={self.rows.budget} "
                f"changes its batch plan: set data.row_budget to at least {need} to resume it (or start a "
                "fresh run)"
            )

    def __len__(self) -> int:
        return self.batches_per_epoch

    # What the plan is built from, besides the lengths: a cursor saved under other values points
    # into another plan. The row budget's fields are 0 when rows are unbounded.
    PLAN_KEYS = ("seed", "token_budget", "max_batch_size", "num_samples", "row_budget", "num_anchors",
                 "block_size")
    # each as the run config names it (a refusal names what to restore)
    PLAN_FIELDS = {"seed": "train.seed", "token_budget": "data.token_budget",
                   "max_batch_size": "data.max_batch_size",
                   "num_samples": "the number of samples in data.path", "row_budget": "data.row_budget",
                   "num_anchors": "objective.num_anchors", "block_size": "drafter.block_size"}

    def _plan_key(self, key: str) -> int:
        if key == "num_samples":
            return len(self.lengths)
        if key in ("row_budget", "num_anchors", "block_size"):
            return 0 if self.rows is None else getattr(self.rows, "budget" if key == "row_budget" else key)
        return getattr(self, key)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "step": self.step,
                "segment_start": self.segment_start, "segment_world_size": self.segment_world_size,
                **{key: self._plan_key(key) for key in self.PLAN_KEYS}}

    def load_state_dict(self, state: dict) -> None:
        if "row_budget" not in state and self.rows is not None:
            self._check_unbounded_cursor(int(state["epoch"]))
        for key in self.PLAN_KEYS:
            mine = self._plan_key(key)
            if key in state and state[key] != mine:
                field = self.PLAN_FIELDS[key]
                fix = ("point data.path at the data it was trained on" if key == "num_samples" else
                       f"restore {field}={state[key]}")
                raise ValueError(
                    f"the data cursor was saved with {field} {state[key]} but this run has {mine}; the batch "
                    f"plan would differ, so the cursor cannot be resumed: {fix}, or start a fresh run in "
                    "another train.output_dir")
        self.epoch, self.consumed, self.step = int(state["epoch"]), int(state["consumed"]), int(state["step"])
        self.segment_start = int(state["segment_start"])
        self.segment_world_size = int(state["segment_world_size"])
        if not 0 <= self.segment_start <= self.consumed <= self._num_global:
            raise ValueError(f"data cursor {state} is outside this plan of {self._num_global} batches")
