"""A drafter family's training: the blocks a micro-batch trains on, their forward + loss, and the
sums the log keeps of that loss.

``strategy_for`` picks the family's strategy once per run, from the drafter and the objective;
the step (train/step.py), the validator (train/validation.py) and the log are handed it and never
test the family. A strategy owns:

- ``blocks`` / ``eval_blocks``: a micro-batch's anchored blocks (objective.make_blocks) with the
  loss terms of its step: the training step's seed, schedule position and tensor-group share, or
  the validator's fixed seed and full weights;
- ``forward_loss``: the drafter's forward on the blocks (``drafter_forward``), then the loss of
  its hidden states (objective.dflash_loss), with soft labels from the target's final states
  when the objective asks for them (objective.SoftLabels);
- ``new_stats``: the device-side sums the log keeps of its LossOutputs (``StepStats``).

``Strategy`` is DFlash's; ``DFlash2Strategy`` adds the selector term: its scheduled weight in the
blocks, the drafter's selector in the loss, its CE and the candidates' recall in the stats. A new
objective lands the same way, in the strategy that trains it. Strategies know no ranks: DDP, the
clip and the optimizer are the backend's (train/backend.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from flashdraft import distributed
from flashdraft.config import ObjectiveConfig
from flashdraft.objective import (
    Blocks,
    LossOutput,
    SelectorLoss,
    SlotLoss,
    SoftLabels,
    default_gamma,
    dflash_loss,
    make_blocks,
)

if TYPE_CHECKING:
    from flashdraft.data.collate import Batch
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.feed import Micro
    from flashdraft.train.optim import SchedulePosition


def _trains_selector(drafter: DFlashDrafter, objective: ObjectiveConfig) -> bool:
    """Whether ``objective`` trains ``drafter``'s candidate selector (DFlash2, selector_alpha > 0)."""
    return drafter.candidate_selector is not None and objective.selector_alpha > 0


def strategy_for(drafter: DFlashDrafter, target, objective: ObjectiveConfig, *, seed: int = 0,
                 shard: tuple[int, int] = (0, 1)) -> Strategy:
    """The strategy that trains ``drafter`` under ``objective`` (the arguments: Strategy's):
    DFlash2's when the drafter has a candidate selector and the objective trains it, else
    DFlash's (a DFlash2 drafter whose selector is frozen, selector_alpha 0, trains its backbone
    as a DFlash drafter does; ``freeze_untrained``)."""
    family = DFlash2Strategy if _trains_selector(drafter, objective) else Strategy
    return family(drafter, target, objective, seed=seed, shard=shard)


def freeze_untrained(drafter: DFlashDrafter, objective: ObjectiveConfig) -> None:
    """Freeze what no strategy trains under ``objective``: a DFlash2 drafter's selector when
    selector_alpha is 0. It would get no gradient, and DDP expects one for every parameter that
    requires it: call this before the drafter is DDP-wrapped."""
    if drafter.candidate_selector is not None and not _trains_selector(drafter, objective):
        drafter.candidate_selector.requires_grad_(False)


class Strategy:
    """DFlash's training, which every family's strategy extends: the per-slot loss
    (objective.SlotLoss: CE, TV or LK; decay or D-PACE weights) of the target's LM head over the
    drafter's block slots, same-position labels, slot 0 unscored."""

    selector = None  # the module that re-ranks the LM head's candidates (DFlash2's); DFlash has none

    def __init__(self, drafter: DFlashDrafter, target, objective: ObjectiveConfig, *, seed: int = 0,
                 shard: tuple[int, int] = (0, 1)):
        """``drafter``: the bare drafter (its block size and MASK id); ``target``: what the blocks
        are embedded and scored with (``embed``, ``lm_head.weight``); ``objective``: the run's
        objective section (anchors, weights, slot loss, chunk and slice sizes); ``seed``:
        train.seed, mixed with the step into each step's anchors; ``shard``: (this rank's place in
        its tensor-parallel target group, the group's size): the group's ranks compute the same
        features and each trains on its share of the blocks (Blocks.shard)."""
        self.drafter, self.target, self.objective = drafter, target, objective
        self.seed, self.shard = seed, shard
        self.slot_loss = SlotLoss.of(objective)
        self.soft = SoftLabels.of(objective)  # the target's features then end in its final states [.., H]
        self.gamma = default_gamma(drafter.block_size) if objective.gamma == 0 else objective.gamma

    # ---- the blocks ---------------------------------------------------------------------------

    def blocks(self, micro: list[Micro], step: int, position: SchedulePosition) -> list[Blocks]:
        """Each micro-batch's anchored blocks at optimizer step ``step``, this rank's share of them:
        the anchors depend on (train.seed, step, sample id) only, the loss terms' weights on the
        step's ``position`` on the run's schedule."""
        seed = self.seed * 1_000_003 + step
        selector = self.selector_term(position.step, position.total)
        return [self._blocks(m.device_batch, m.device_ids, seed, selector).shard(*self.shard) for m in micro]

    def eval_blocks(self, batch: Batch, sample_ids: torch.Tensor) -> Blocks:
        """A held-out batch's blocks: fixed anchors (seed 0), every term at its full weight (its
        schedule's end, so that evals compare across the run), all of them (the eval runs whole)."""
        return self._blocks(batch, sample_ids, 0, self.selector_term(1.0, 1.0))

    def _blocks(self, batch: Batch, sample_ids: torch.Tensor, seed: int, selector: SelectorLoss | None):
        drafter = self.drafter
        return make_blocks(batch.input_ids, batch.loss_mask, batch.lengths, block_size=drafter.block_size,
                           mask_token_id=drafter.mask_token_id, num_anchors=self.objective.num_anchors,
                           gamma=self.gamma, loss=self.slot_loss, seed=seed, sample_ids=sample_ids,
                           selector=selector)

    def selector_term(self, step: float, total: float) -> SelectorLoss | None:
        """DFlash2's selector term at schedule position ``step`` of ``total`` (DFlash: none)."""
        return None

    def slices(self, blocks: Blocks) -> list[Blocks]:
        """``blocks`` in forward + backward passes of objective.anchors_per_microbatch anchors
        (0: one pass), so that only one slice's activations live at a time."""
        return blocks.slices(self.objective.anchors_per_microbatch)

    # ---- the forward and the loss -------------------------------------------------------------

    def drafter_forward(self, model, features: torch.Tensor, blocks: Blocks, *, attention: str | None = None,
                        scored_only: bool = True, distinct_rows: bool = True) -> torch.Tensor:
        """The drafter's hidden states on ``blocks`` conditioned on target ``features`` [B, S, K*H],
        run through ``model`` (the drafter, or the backend's DDP wrapper of it), the blocks'
        tokens embedded by the target.

        The defaults are the training step's fast path: slot 0 is not computed in the last layer
        and the head (``scored_only``), and layer 0 projects the distinct rows only, the anchors'
        embeddings and the one MASK embedding (``distinct_rows``). ``scored_only=False,
        distinct_rows=False, attention="dense"`` is the straightforward oracle (every slot of
        every block embedded in full); all give the same loss and gradients
        (tests/test_step_equivalence.py)."""
        embed = self.target.embed
        if distinct_rows:
            embeds = embed(blocks.input_ids[:, :, 0]).to(features.dtype)  # the other slots are MASK
            mask_embed = embed(blocks.input_ids.new_tensor(self.drafter.mask_token_id)).to(features.dtype)
        else:
            embeds, mask_embed = embed(blocks.input_ids).to(features.dtype), None
        return model(features, embeds, blocks.anchors, blocks.valid, attention=attention,
                     scored_only=scored_only, mask_embed=mask_embed)

    def forward_loss(self, model, features: torch.Tensor, blocks: Blocks,
                     normalizer: torch.Tensor | None = None, **options) -> LossOutput:
        """One forward of ``blocks`` through ``model`` (``drafter_forward``; ``options`` are its
        oracle switches), then the loss of its hidden states under the target's LM head
        (objective.dflash_loss, in chunks of objective.loss_chunk_size slots), divided by
        ``normalizer`` (default: the blocks' weight sum). The loss never calls the drafter."""
        taps = features[..., :self.drafter.fc.in_features]  # with soft labels the target's final states follow
        hidden = self.drafter_forward(model, taps, blocks, **options)
        teacher = None
        if self.soft is not None:
            bs = self.drafter.block_size
            teacher = self.soft.teacher(features[..., taps.shape[-1]:], blocks.anchors, bs, bs - hidden.shape[2])
        return dflash_loss(hidden, self.target.lm_head.weight, blocks.labels, blocks.weights,
                           self.objective.loss_chunk_size, normalizer, slot_loss=blocks.loss,
                           selector=self.selector, selector_loss=blocks.selector, teacher=teacher)

    def new_stats(self, device: torch.device) -> StepStats:
        """Empty sums of this strategy's LossOutputs, on ``device``."""
        return StepStats(self.drafter.block_size, device)


class DFlash2Strategy(Strategy):
    """DFlash2 (DFLASH2.md): DFlash's loss plus the selector term (objective.SelectorLoss), whose
    weight follows its warm-up / ramp schedule; the drafter's selector re-ranks the LM head's
    top-k candidates of each slot, and the stats log its CE and the candidates' recall."""

    def __init__(self, drafter: DFlashDrafter, target, objective: ObjectiveConfig, **kwargs):
        super().__init__(drafter, target, objective, **kwargs)
        self.selector = drafter.candidate_selector

    def selector_term(self, step: float, total: float) -> SelectorLoss | None:
        return SelectorLoss.of(self.objective, step, total)

    def new_stats(self, device: torch.device) -> StepStats:
        return SelectorStats(self.drafter.block_size, device)


class StepStats:
    """Device-side sums of the LossOutputs added since the last log (no host sync until logging):
    the base term's loss and weight, and per scored slot 1 .. bs-1 the hits and counts."""

    def __init__(self, block_size: int, device: torch.device):
        zeros = functools.partial(torch.zeros, device=device, dtype=torch.float64)
        self.loss_total, self.weight_total = zeros(()), zeros(())
        self.hits, self.counts = zeros(block_size - 1), zeros(block_size - 1)
        self.trained = zeros(())  # outputs added: 0 when every step since the last log was skipped

    def add(self, out: LossOutput) -> None:
        self.loss_total += out.total.double()
        self.trained += 1
        self.weight_total += out.weight_sum.double()
        self.hits += (out.correct & out.scored).flatten(0, 1).sum(0)[1:].double()
        self.counts += out.scored.flatten(0, 1).sum(0)[1:].double()

    def reduce(self) -> dict:
        """All-reduce over ranks and return host floats (deliberate sync: log time only)."""
        return self._values(distributed.all_reduce(self._packed(), "sum"))

    def reduce_local(self) -> dict:
        """This rank's values only (used by rank-0 evaluation)."""
        return self._values(self._packed())

    def _sums(self) -> list[torch.Tensor]:
        """Every sum but ``trained``, in the order they are packed (a subclass appends its own)."""
        return [self.loss_total.view(1), self.weight_total.view(1), self.hits, self.counts]

    def _packed(self) -> torch.Tensor:
        return torch.cat([*self._sums(), self.trained.view(1)])

    def _values(self, packed: torch.Tensor) -> dict:
        """The loss statistics; none at all (no loss, acc or tau) when no step since the last log
        was trained, every one skipped: a 0 there would plot as a perfect loss."""
        packed = packed.cpu()
        return self._statistics(packed[:-1]) if packed[-1] != 0 else {}

    def _statistics(self, sums: torch.Tensor) -> dict:
        """The values of ``sums`` (on the host, in ``_sums``' order)."""
        n = self.hits.numel()
        acc = sums[2 : 2 + n] / sums[2 + n : 2 + 2 * n].clamp(min=1)
        return {
            "loss": float(sums[0] / sums[1].clamp(min=1e-12)),
            "acc": float(acc.mean()),
            "acc_first": float(acc[0]),
            "tau_sim": float(1 + acc.cumprod(0).sum()),
        }


class SelectorStats(StepStats):
    """DFlash2's: StepStats plus the selector term's sum (before its alpha) and the scored slots
    whose label was among the candidates; ``acc`` is then the selector's picks'."""

    def __init__(self, block_size: int, device: torch.device):
        super().__init__(block_size, device)
        self.selector_total = torch.zeros((), device=device, dtype=torch.float64)
        self.recalled = torch.zeros((), device=device, dtype=torch.float64)

    def add(self, out: LossOutput) -> None:
        super().add(out)
        self.selector_total += out.selector_total.double()
        self.recalled += (out.recall & out.scored).sum().double()

    def _sums(self) -> list[torch.Tensor]:
        return [*super()._sums(), self.selector_total.view(1), self.recalled.view(1)]

    def _statistics(self, sums: torch.Tensor) -> dict:
        """StepStats', the selector CE on the base term's scale and the candidates' top-k recall."""
        n = self.hits.numel()
        return {**super()._statistics(sums),
                "selector_loss": float(sums[-2] / sums[1].clamp(min=1e-12)),
                "topk_recall": float(sums[-1] / sums[2 + n : 2 + 2 * n].sum().clamp(min=1))}
