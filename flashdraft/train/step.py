"""The training step: one optimizer step of the drafter over a step's micro-batches.

``DrafterStep.__call__`` is the whole step (main thread, features already computed by the
target stage; its schedule position given by the loop), strategy then backend: the strategy
(train/strategy.py, the drafter family's) draws every micro-batch's anchored blocks, the backend
(train/backend.py) agrees on the GLOBAL loss normaliser (one tiny all-reduce, no host sync), then
per micro-batch ``forward_backward``: the strategy's forward + loss, the backend's backward (DDP
syncs the gradients on the last backward of the step only); then the backend clips, votes, steps
and schedules. The vote is the step's one host sync. The step never tests the drafter family.

``forward_backward`` is also what ``flashdraft bench step`` times and what the equivalence tests
check against the oracle.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from flashdraft.feed import Micro
    from flashdraft.objective import Blocks, LossOutput
    from flashdraft.train.backend import Backend
    from flashdraft.train.optim import SchedulePosition
    from flashdraft.train.strategy import StepStats, Strategy

# The default ``autocast`` of forward_backward: a nullcontext can be entered repeatedly.
_NO_AUTOCAST = contextlib.nullcontext()


def _stage(timer, name: str):
    return timer.stage(name) if timer is not None else contextlib.nullcontext()


def forward_backward(
    strategy: Strategy, backend: Backend, features: torch.Tensor, blocks: Blocks, *,
    normalizer: torch.Tensor | None = None, sync: bool = True, timer=None, autocast=_NO_AUTOCAST, **options,
) -> list[LossOutput]:
    """Forward, loss and backward of one micro-batch's ``blocks`` conditioned on ``features``
    [B, S, K*H]: per slice, ``strategy.forward_loss`` through ``backend.model``, then
    ``backend.backward``; gradients accumulate in .grad.

    The anchors run in the strategy's slices (objective.anchors_per_microbatch), each a forward +
    backward, so only one slice's activations live at a time; every slice is normalised by
    ``normalizer`` (default: the micro-batch's sum of weights), so the loss and gradients equal
    the one-pass step. ``sync=False`` keeps DDP from all-reducing on any of these backwards (the
    step syncs on its last one only). ``timer`` (a StageTimer) times the "drafter" (forward +
    loss, under ``autocast``) and "backward" stages; ``options`` go to
    ``strategy.drafter_forward`` (the oracle's switches). Returns one LossOutput per slice."""
    if normalizer is None:
        normalizer = blocks.weight_sum
    parts = strategy.slices(blocks)
    outs = []
    for i, part in enumerate(parts):
        with backend.accumulating(sync and i == len(parts) - 1):
            with _stage(timer, "drafter"), autocast, backend.forwarding():
                out = strategy.forward_loss(backend.model, features, part, normalizer, **options)
            with _stage(timer, "backward"):
                backend.backward(out.loss)
        outs.append(out)
    return outs


@dataclass
class NonFinite:
    """A skipped step's evidence, on the device until it is reported: per micro-batch, which
    samples' target features were finite [B] and whether its loss was."""

    grad_norm: torch.Tensor
    checks: list[tuple[torch.Tensor, torch.Tensor]]


class StepResult(NamedTuple):
    """What one optimizer step tells the loop: the grad norm (device), the evidence of a skipped
    step (None when it was applied), and the signal any rank had been asked to stop by when
    the ranks voted (0: none; every rank gets the same value)."""

    grad_norm: torch.Tensor
    nonfinite: NonFinite | None
    stop: int


class DrafterStep:
    """The optimizer step, built once per run from the run's strategy and backend (see module doc)."""

    def __init__(self, strategy: Strategy, backend: Backend, timer=None, autocast=_NO_AUTOCAST, stop=None):
        """``timer``: the main thread's StageTimer; ``autocast``: the drafter's mixed precision;
        ``stop``: the run's GracefulStop (its ``signum`` is this rank's stop request, carried by the
        step's vote); None: never stops."""
        self.strategy, self.backend, self.stop = strategy, backend, stop
        self.timer, self.autocast = timer, autocast

    def __call__(self, micro: list[Micro], step: int, position: SchedulePosition,
                 stats: StepStats) -> StepResult:
        """Optimizer step ``step`` over ``micro`` (their features computed); ``position``: its place
        on the run's schedule (RunScheduler.position), which step-dependent loss weights follow.
        Adds the step's LossOutputs to ``stats`` unless it was skipped. See StepResult."""
        blocks = self.strategy.blocks(micro, step, position)
        with _stage(self.timer, "sync"):
            normalizer = self.backend.normalizer([blk.weight_sum for blk in blocks])
        outs = [forward_backward(self.strategy, self.backend, m.features, blk, normalizer=normalizer,
                                 sync=k == len(micro) - 1, timer=self.timer, autocast=self.autocast)
                for k, (m, blk) in enumerate(zip(micro, blocks))]
        # Device-side, read only when the step turns out non-finite: which samples' target
        # features were non-finite, and whether each micro-batch's loss was.
        checks = [(torch.isfinite(m.features).flatten(1).all(1),
                   torch.isfinite(torch.stack([o.terms_total for o in mo])).all())
                  for m, mo in zip(micro, outs)]
        for m in micro:
            m.features = None  # drop the references early: memory
        with _stage(self.timer, "optim"):
            update = self.backend.step(torch.stack([loss_ok for _, loss_ok in checks]).all(),
                                       self.stop.signum if self.stop is not None else 0)
            if update.applied:  # a skipped step's NaNs stay out of the logged loss too
                for out in (o for mo in outs for o in mo):
                    stats.add(out)
        return StepResult(update.grad_norm, None if update.applied else NonFinite(update.grad_norm, checks),
                          update.stop)


def describe_nonfinite(found: NonFinite, micro, dataset, step: int, rank: int, skipped_so_far: int) -> str:
    """Where a skipped step's non-finite values came from, naming the samples (rows of the
    source file, not plan indices) and the fix."""
    rows = [dataset.source_index[m.sample_ids] for m in micro]
    stage = None
    for k, (features_ok, _) in enumerate(found.checks):
        bad = rows[k][~features_ok.cpu().numpy()]
        if len(bad):
            stage = (f"target forward: non-finite target features for samples {bad[:16].tolist()} of "
                     f"{dataset.report.source} (micro-batch {k}); check those samples and the target's "
                     "weights")
            break
    bad_loss = [k for k, (_, loss_ok) in enumerate(found.checks) if not bool(loss_ok)]
    if stage is None and bad_loss:
        stage = f"drafter forward: non-finite loss in micro-batch {bad_loss[0]} (features were finite)"
    elif stage is None and not torch.isfinite(found.grad_norm):
        stage = "backward: non-finite gradients (loss and features were finite)"
    elif stage is None:
        stage = "another rank's (this rank's features, loss and gradients were finite)"
    samples = np.concatenate(rows).tolist()
    return (f"step {step}: non-finite values on rank {rank} (grad norm {float(found.grad_norm)}), "
            f"stage {stage}; step skipped, weights unchanged ({skipped_so_far} skipped so far); batch "
            f"samples {samples[:16]}{'...' if len(samples) > 16 else ''}")
