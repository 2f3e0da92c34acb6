"""The training step: one optimizer step of the drafter over a step's micro-batches.

``DrafterStep.__call__`` is the whole step (main thread, features already computed by the
target stage; its schedule position given by the loop): draw every micro-batch's anchored
blocks (objective), agree on the GLOBAL loss normaliser (one tiny all-reduce, no host sync),
forward + loss + backward per micro-batch (``forward_backward``; DDP syncs the gradients on the
last backward of the step only), then clip, vote, step and schedule. The vote is the step's one
host sync: a single all-reduce of two numbers over the ranks, whether any rank's step was
non-finite (then every rank skips it) and the signal any rank has been asked to stop by (then
every rank stops after it; a signal that comes after a step's vote is carried by the next one).

The step is the one place that joins the model and the loss: ``forward_loss`` runs the drafter
(``drafter_forward``), then hands its hidden states to the objective's loss, which never calls
the drafter. ``forward_backward`` is also what ``flashdraft bench step`` times and what the
equivalence tests check against the oracle.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from flashdraft import distributed
from flashdraft.config import Config
from flashdraft.objective import Blocks, LossOutput, SelectorLoss, SlotLoss, dflash_loss, make_blocks
from flashdraft.train.optim import SchedulePosition

# The default ``autocast`` of forward_backward: a nullcontext can be entered repeatedly.
_NO_AUTOCAST = contextlib.nullcontext()


def _stage(timer, name: str):
    return timer.stage(name) if timer is not None else contextlib.nullcontext()


def drafter_forward(model, target, features: torch.Tensor, blocks: Blocks, *, attention: str | None = None,
                    scored_only: bool = True, distinct_rows: bool = True) -> torch.Tensor:
    """The drafter's hidden states on ``blocks`` conditioned on target ``features`` [B, S, K*H]
    (``model``: the drafter, DDP-wrapped or not), the blocks' tokens embedded by the target.

    The defaults are the training step's fast path: slot 0 is not computed in the last layer and
    the head (``scored_only``), and layer 0 projects the distinct rows only, the anchors' embeddings
    and the one MASK embedding (``distinct_rows``). ``scored_only=False, distinct_rows=False,
    attention="dense"`` is the straightforward oracle (every slot of every block embedded in
    full); all give the same loss and gradients (tests/test_step_equivalence.py)."""
    if distinct_rows:
        embeds = target.embed(blocks.input_ids[:, :, 0]).to(features.dtype)  # the other slots are MASK
        mask_embed = target.embed(blocks.input_ids.new_tensor(_unwrapped(model).mask_token_id)).to(features.dtype)
    else:
        embeds, mask_embed = target.embed(blocks.input_ids).to(features.dtype), None
    return model(features, embeds, blocks.anchors, blocks.valid, attention=attention, scored_only=scored_only,
                 mask_embed=mask_embed)


def forward_loss(model, target, features: torch.Tensor, blocks: Blocks, *, chunk_size: int = 0,
                 normalizer: torch.Tensor | None = None, **options) -> LossOutput:
    """One forward of ``blocks``: the drafter (``drafter_forward``; ``options`` are its oracle
    switches), then the objective's loss of its hidden states under the target's LM head, with
    DFlash2's selector term when ``blocks.selector`` is set (the drafter's selector scores the
    head's candidates). ``chunk_size`` and ``normalizer``: objective.dflash_loss's."""
    hidden = drafter_forward(model, target, features, blocks, **options)
    selector = _unwrapped(model).candidate_selector if blocks.selector is not None else None
    return dflash_loss(hidden, target.lm_head.weight, blocks.labels, blocks.weights, chunk_size, normalizer,
                       slot_loss=blocks.loss, selector=selector, selector_loss=blocks.selector)


def _unwrapped(model):
    """The drafter of a DDP-wrapped ``model`` (or ``model`` itself)."""
    return getattr(model, "module", model)


def forward_backward(
    model, target, features: torch.Tensor, blocks: Blocks, *, normalizer: torch.Tensor | None = None,
    chunk_size: int = 0, anchors_per_slice: int = 0, sync: bool = True, timer=None,
    autocast=_NO_AUTOCAST, **options,
) -> list[LossOutput]:
    """Forward, loss and backward of one micro-batch's ``blocks``; gradients accumulate in .grad.

    The anchors run in slices of ``anchors_per_slice`` (0: all at once), each a forward +
    backward, so only one slice's activations live at a time; every slice is normalised by
    ``normalizer`` (default: the micro-batch's sum of weights), so the loss and gradients equal
    the one-pass step. ``sync=False`` keeps a DDP ``model`` from all-reducing on any of these
    backwards (the step syncs on its last one only). ``timer`` (a StageTimer) times the
    "drafter" (forward + loss, under ``autocast``) and "backward" stages; ``options`` go to
    ``drafter_forward`` (the oracle's switches). Returns one LossOutput per slice."""
    if normalizer is None:
        normalizer = blocks.weight_sum
    parts = blocks.slices(anchors_per_slice)
    outs = []
    for i, part in enumerate(parts):
        syncs = sync and i == len(parts) - 1
        no_sync = model.no_sync() if isinstance(model, DDP) and not syncs else contextlib.nullcontext()
        with no_sync:
            with _stage(timer, "drafter"), autocast, distributed.collective_errors("DDP forward"):
                out = forward_loss(model, target, features, part, chunk_size=chunk_size, normalizer=normalizer,
                                   **options)
            # includes DDP's overlapped gradient all-reduce: a dead peer surfaces here
            with _stage(timer, "backward"), distributed.collective_errors("DDP gradient all-reduce (backward)"):
                out.loss.backward()
        outs.append(out)
    return outs


@dataclass
class StepStats:
    """Device-side sums since the last log (no host sync until logging)."""

    loss_total: torch.Tensor
    weight_total: torch.Tensor
    hits: torch.Tensor  # [bs - 1]
    counts: torch.Tensor  # [bs - 1]
    selector_total: torch.Tensor  # DFlash2: the selector term's sum (before its alpha)
    recalled: torch.Tensor  # DFlash2: scored slots whose label was among the candidates
    trained: torch.Tensor  # outputs added: 0 when every step since the last log was skipped
    selector: bool = False  # a DFlash2 LossOutput was added (its two values are logged)

    @classmethod
    def zeros(cls, block_size: int, device) -> StepStats:
        z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float64)  # noqa: E731
        return cls(z(()), z(()), z(block_size - 1), z(block_size - 1), z(()), z(()), z(()))

    def add(self, out: LossOutput) -> None:
        self.loss_total += out.total.double()
        self.trained += 1
        self.weight_total += out.weight_sum.double()
        self.hits += (out.correct & out.scored).flatten(0, 1).sum(0)[1:].double()
        self.counts += out.scored.flatten(0, 1).sum(0)[1:].double()
        if out.recall is not None:
            self.selector = True
            self.selector_total += out.selector_total.double()
            self.recalled += (out.recall & out.scored).sum().double()

    def reduce(self) -> dict:
        """All-reduce over ranks and return host floats (deliberate sync: log time only)."""
        return self._values(distributed.all_reduce(self._packed(), "sum"))

    def reduce_local(self) -> dict:
        """This rank's values only (used by rank-0 evaluation)."""
        return self._values(self._packed())

    def _packed(self) -> torch.Tensor:
        return torch.cat([self.loss_total.view(1), self.weight_total.view(1), self.hits, self.counts,
                          self.selector_total.view(1), self.recalled.view(1), self.trained.view(1)])

    def _values(self, packed: torch.Tensor) -> dict:
        """The loss statistics; none at all (no loss, acc or tau) when no step since the last log
        was trained, every one skipped: a 0 there would plot as a perfect loss."""
        packed = packed.cpu()
        if packed[-1] == 0:
            return {}
        packed = packed[:-1]
        n = self.hits.numel()
        counts = packed[2 + n : 2 + 2 * n]
        acc = packed[2 : 2 + n] / counts.clamp(min=1)
        values = {
            "loss": float(packed[0] / packed[1].clamp(min=1e-12)),
            "acc": float(acc.mean()),
            "acc_first": float(acc[0]),
            "tau_sim": float(1 + acc.cumprod(0).sum()),
        }
        if self.selector:  # the selector CE on the base term's scale, and the candidates' top-k recall
            values["selector_loss"] = float(packed[-2] / packed[1].clamp(min=1e-12))
            values["topk_recall"] = float(packed[-1] / counts.sum().clamp(min=1))
        return values


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
    """The optimizer step, built once per run from the trainer's parts (see module doc)."""

    def __init__(self, model, drafter, target, optimizer, scheduler, cfg: Config, gamma: float | None, timer,
                 autocast, world_size: int, tensor: tuple[int, int] = (0, 1), stop=None):
        """``tensor``: (this rank's place in its target group, the group's size): the ranks of a
        tensor-parallel target group compute the same features and each trains on its share of
        every micro-batch's anchored blocks (Blocks.shard). ``stop``: the run's GracefulStop (its
        ``signum`` is this rank's stop request, carried by the step's vote); None: never stops."""
        self.model, self.drafter, self.target = model, drafter, target
        self.optimizer, self.scheduler = optimizer, scheduler
        self.cfg, self.gamma, self.timer, self.autocast, self.world_size = cfg, gamma, timer, autocast, world_size
        self.tensor_rank, self.tensor_size = tensor
        self.stop = stop

    def blocks(self, micro, step: int, position: SchedulePosition) -> list[Blocks]:
        """Each micro-batch's anchored blocks; the anchors depend on (seed, step, sample id) only,
        DFlash2's selector term on the step's ``position`` on the schedule."""
        cfg = self.cfg
        selector = None
        if self.drafter.candidate_selector is not None:  # DFlash2: the selector term's weight at this step
            selector = SelectorLoss.of(cfg.objective, position.step, position.total)
        return [make_blocks(m.device_batch.input_ids, m.device_batch.loss_mask, m.device_batch.lengths,
                            block_size=self.drafter.block_size, mask_token_id=self.drafter.mask_token_id,
                            num_anchors=cfg.objective.num_anchors, gamma=self.gamma, loss=SlotLoss.of(cfg.objective),
                            seed=cfg.train.seed * 1_000_003 + step, sample_ids=m.device_ids,
                            selector=selector).shard(self.tensor_rank, self.tensor_size)
                for m in micro]

    def __call__(self, micro, step: int, position: SchedulePosition, stats: StepStats) -> StepResult:
        """Optimizer step ``step`` over ``micro`` (their features computed); ``position``: its place
        on the run's schedule (RunScheduler.position), which DFlash2's selector weight follows.
        See StepResult."""
        obj = self.cfg.objective
        blocks = self.blocks(micro, step, position)
        with _stage(self.timer, "sync"):
            # The global normaliser makes any split of the batch (ranks x micro-batches) give the
            # same gradient; DDP averages over ranks, hence the world_size factor.
            normalizer = distributed.all_reduce(torch.stack([blk.weight_sum for blk in blocks]).sum(), "sum")
            normalizer = normalizer / self.world_size
        outs = [forward_backward(self.model, self.target, m.features, blk, normalizer=normalizer,
                                 chunk_size=obj.loss_chunk_size, anchors_per_slice=obj.anchors_per_microbatch,
                                 sync=k == len(micro) - 1, timer=self.timer, autocast=self.autocast)
                for k, (m, blk) in enumerate(zip(micro, blocks))]
        # Device-side, read only when the step turns out non-finite: which samples' target
        # features were non-finite, and whether each micro-batch's loss was.
        checks = [(torch.isfinite(m.features).flatten(1).all(1),
                   torch.isfinite(torch.stack([o.total if o.selector_total is None else o.total + o.selector_total
                                               for o in mo])).all())
                  for m, mo in zip(micro, outs)]
        for m in micro:
            m.features = None  # drop the references early: memory
        return self._apply([o for mo in outs for o in mo], checks, stats)

    def _apply(self, outs: list[LossOutput], checks, stats: StepStats) -> StepResult:
        with _stage(self.timer, "optim"):
            clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip)
            bad, stop = self._vote(grad_norm, checks)
            skipped = None
            if not bad:
                self.optimizer.step()
                for out in outs:  # a skipped step's NaNs stay out of the logged loss too
                    stats.add(out)
            else:
                skipped = NonFinite(grad_norm, checks)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        return StepResult(grad_norm, skipped, stop)

    def _vote(self, grad_norm: torch.Tensor, checks) -> tuple[bool, int]:
        """(whether any rank's step was non-finite, the signal any rank was asked to stop by):
        one all-reduce (max) of both, read once. The step's deliberate host sync: all ranks must
        agree to skip (a local NaN loss need not reach every rank's gradients) and never let a
        non-finite loss or gradient into the weights; and all must stop at the same step. Both
        ride in one tensor, so a multi-node job pays one cross-node round trip per step, not two."""
        bad = ~torch.isfinite(grad_norm) | ~torch.stack([loss_ok for _, loss_ok in checks]).all()
        signum = float(self.stop.signum) if self.stop is not None else 0.0
        # on the grad norm's device: an NCCL group takes no host tensors
        votes = torch.stack([bad.to(grad_norm.device, torch.float32),
                             torch.tensor(signum, device=grad_norm.device)])
        bad_any, stop = distributed.all_reduce(votes, "max").tolist()
        return bad_any != 0, int(stop)


def describe_nonfinite(found: NonFinite, micro, dataset, step: int, rank: int, skipped_so_far: int) -> str:
    """Where a skipped step's non-finite values came from, naming the samples (rows of the
    source file, not plan indices) and the fix."""
    rows = [dataset.source_index[m.sample_ids] for m in micro]
    stage = None
    for k, (features_ok, _) in enumerate(found.checks):
        bad = rows[k][~features_ok.cpu().numpy()]
        if len(bad):
            stage = (f"target forward: non-finite target features for samples {bad[:16].tolist()} of "
                     f"{dataset.report.source} (micro-batch {k}); check those samples and the target's weights")
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
            f"stage {stage}; step skipped, weights unchanged ({skipped_so_far} skipped so far); batch samples "
            f"{samples[:16]}{'...' if len(samples) > 16 else ''}")
