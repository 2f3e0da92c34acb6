"""The DFlash training objective: anchors, block inputs, the block mask, labels, weights, loss.

Conventions (DFLASH.md): a block anchored at ``a`` holds [tok_a, MASK, ..., MASK] at positions
a .. a + bs - 1; slot k > 0 is labelled with the token AT position a + k (same-position, not
next-token), slot 0 is never scored; the block sees context strictly before ``a`` and its own
slots (bidirectionally), never another block.

Nothing here calls the drafter: the step (train/step.py) runs it and hands its hidden states to
``dflash_loss``, whose LM head + CE kernels are drafter/head_kernels.py's. Everything here is
vectorised and stays on the device: no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdraft.config import ObjectiveConfig
from flashdraft.data.batching import anchor_slots
from flashdraft.drafter.head_kernels import Teacher, head_ce


def default_gamma(block_size: int) -> float:
    """The published decay: 7 for bs 16, 5 for 10, 4 for 8 (~ interpolated elsewhere)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


_MASK64 = (1 << 64) - 1


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [R, n] (detached) of blocks' per-slot CE [R, n] and 0/1 validity.

    q_k = exp(-CE_k) is the drafter's probability of the label, q~_k = (1 - alpha) q_k + alpha,
    C_k = prod_{i <= k} q~_i over valid slots (an invalid slot is a no-op: q~ = 1), and
    w_k = sum_{m >= k, m valid} C_m -- the expected accepted length's gradient with respect to
    log q~_k, so weight moves to later slots as the early ones become confident. Invalid slots
    weigh 0. (D-PACE, arXiv 2605.18810, Eq. 7-9.)

    The suffix sums are one fp64 matmul with a triangular 0/1 matrix, not a float cumsum: CUDA's
    float cumsum raises under train.deterministic (torch.use_deterministic_algorithms), and a
    matmul over n <= block size slots costs nothing."""
    ce, valid = ce.detach().float(), valid.detach() > 0
    q = torch.where(valid, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
    c = q.cumprod(-1) * valid
    n = c.shape[-1]
    suffix = torch.ones(n, n, dtype=torch.float64, device=c.device).tril()  # [m, k]: 1 where m >= k
    return (c.double() @ suffix).float() * valid


def accept_until_fail(correct: torch.Tensor, scored: torch.Tensor, factor: float = 0.0) -> torch.Tensor:
    """Accept-until-fail weights [blocks, n] (detached, float32) of each block's slots from their
    correctness (the drafter's argmax equals the label) and scored-ness, [blocks, n] bool.

    At serving time a slot after the block's first rejected draft is never accepted, whatever it
    predicts: its loss teaches nothing that decoding will use. So each scored slot strictly after
    the block's first scored miss weighs ``factor`` (0: dropped), every other slot 1; the miss
    itself keeps its weight (it is the slot that ended the block). Unscored slots do not end a
    block (they weigh 0 in the loss anyway). (Spec-AUF, arXiv 2607.01893.)"""
    misses = (scored & ~correct).to(torch.int32)
    after_first_miss = (misses.cumsum(-1) - misses) > 0
    return torch.where(after_first_miss, torch.full_like(correct, factor, dtype=torch.float32),
                       torch.ones_like(correct, dtype=torch.float32))


@dataclass(frozen=True)
class SlotLoss:
    """What each scored slot contributes, from its CE against the hard label (DFLASH2.md 5.1):

    - ``ce``: CE (equal to LK^alpha, -log of the acceptance probability, for a one-hot target);
    - ``tv``: the total variation 1 - q(y), q the drafter's probability of the label;
    - ``lk_lambda``: lambda * CE + (1 - lambda) * TV with lambda = kl_scale * exp(-kl_decay * a),
      a = the mean q(y) over the forward's scored slots, detached (SpecForge's batch-level form;
      per forward, so splitting a batch into micro-batches, ranks or anchor slices changes it).

    ``dpace_alpha`` weights the slots by D-PACE first (else the given weights). ``rows`` maps
    the per-row CE [R] to (each row's loss [R], differentiable where ``ce`` is, and each row's
    d loss / d CE [R], detached): the chunked LM head scales each row's CE gradient by the latter.
    """

    kind: str = "ce"
    dpace_alpha: float | None = None
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    auf_factor: float | None = None  # accept-until-fail: the weight of a block's slots after its first miss

    @classmethod
    def of(cls, objective: ObjectiveConfig) -> SlotLoss:
        """The slot loss a run's ``objective`` config sets (objective.loss, D-PACE's alpha when
        objective.weighting=dpace, the LK mix's scale and decay, accept-until-fail's factor)."""
        dpace_alpha = objective.dpace_alpha if objective.weighting == "dpace" else None
        auf_factor = objective.auf_factor if objective.accept_until_fail else None
        return cls(objective.loss, dpace_alpha, objective.lk_kl_scale, objective.lk_kl_decay, auf_factor)

    @property
    def plain(self) -> bool:
        """Fixed weights times the base loss: the chunked head's single-pass path."""
        return self.kind == "ce" and self.dpace_alpha is None and self.auf_factor is None

    def slot_weights(self, ce: torch.Tensor, weights: torch.Tensor, slots: int) -> torch.Tensor:
        """Each row's weight [R] (float32): ``weights`` itself, or under D-PACE the detached
        D-PACE weights of its block from the rows' CE [R] and 0/1 validity ``weights``."""
        if self.dpace_alpha is None:
            return weights.float()
        return dpace_weights(ce.view(-1, slots), weights.view(-1, slots), self.dpace_alpha).view(-1)

    def rows(self, base: torch.Tensor, ce: torch.Tensor, correct: torch.Tensor, weights: torch.Tensor,
             slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's loss [R] and its derivative by the row's ``base`` loss (CE, or the soft-label
        mix), from the rows' CE and argmax correctness [R], for rows of ``slots`` slots per block.
        TV and LK are functions of the CE, so their ``base`` is the CE."""
        fixed = ce.detach()
        w = self.slot_weights(fixed, weights, slots)
        if self.auf_factor is not None:  # from the head's argmax: known only after its pass
            w = w * accept_until_fail(correct.view(-1, slots), (weights > 0).view(-1, slots), self.auf_factor).view(-1)
        if self.kind == "ce":
            return w * base, w
        ce = base
        q = torch.exp(-fixed)
        tv = w * (1 - torch.exp(-ce))
        if self.kind == "tv":
            return tv, w * q
        scored = (weights > 0).float()  # a: the plain mean of q(y) over the scored slots (DFLASH2.md 5.1)
        lam = self.kl_scale * torch.exp(-self.kl_decay * (scored * q).sum() / scored.sum().clamp(min=1))
        return lam * w * ce + (1 - lam) * tv, w * (lam + (1 - lam) * q)


@dataclass(frozen=True)
class SoftLabels:
    """Soft labels from the target (objective.kd_weight, kd_temperature): each scored slot's loss
    is (1 - weight) * CE + weight * T^2 * KL(p || q) of the target's distribution p over the
    slot's token (its logits one position before it, from its final normed hidden state through
    the shared LM head: ``teacher_rows``) against the drafter's q, both at temperature T."""

    weight: float
    temperature: float = 1.0

    @classmethod
    def of(cls, objective: ObjectiveConfig) -> SoftLabels | None:
        return cls(objective.kd_weight, objective.kd_temperature) if objective.kd_weight > 0 else None

    def teacher(self, states: torch.Tensor, anchors: torch.Tensor, block_size: int, skip: int) -> Teacher:
        """The head kernel's Teacher for rows [B * N * (bs - skip)] of slots skip .. bs - 1 of the
        blocks at ``anchors`` [B, N]: the target's final states [B, S, H] one position before each
        slot's label (slot k of the block at a is labelled with the token at a + k, which the
        target predicted at a + k - 1; positions past the sample are clamped: those slots weigh 0)."""
        b, s, h = states.shape
        positions = anchors.unsqueeze(-1) + torch.arange(skip - 1, block_size - 1, device=anchors.device)
        index = positions.clamp(0, s - 1).reshape(b, -1, 1).expand(-1, -1, h)
        return Teacher(states.gather(1, index).reshape(-1, h), self.temperature, self.weight)


@dataclass(frozen=True)
class SelectorLoss:
    """DFlash2's selector term (DFLASH2.md 1.4): sum_k w_k * hit_k * CE(scores_k, j*_k) over the
    scored slots, added to the base term with weight ``alpha`` (this step's, after the warm-up /
    ramp schedule) before the shared normaliser. The candidates are the head's top-k of the slot
    (strict: a label outside them adds nothing), the predecessor of slot k is the token at a + k - 1
    (teacher forcing: the anchor for slot 1), and w_k is the base term's weight (the decay, or the
    block's D-PACE weight from its full CE). ``stop_gradient``: the selector CE trains the
    selector alone (the unary logits and the drafter's hidden states detached inside it)."""

    alpha: float = 1.0
    stop_gradient: bool = False

    @classmethod
    def of(cls, objective: ObjectiveConfig, position: float, total_steps: float) -> SelectorLoss | None:
        """The selector term a run's ``objective`` config sets at schedule position ``position`` (the
        optimizer step, 0-based) of ``total_steps``; None when the selector is frozen (selector_alpha 0)."""
        if objective.selector_alpha == 0:
            return None
        alpha = selector_schedule(objective.selector_alpha, objective.selector_warmup_frac,
                                  objective.selector_ramp_frac, position, total_steps)
        return cls(alpha, objective.selector_stop_gradient)


def selector_schedule(alpha: float, warmup_frac: float, ramp_frac: float, step: float, total_steps: float) -> float:
    """The selector term's weight at optimizer step ``step`` (0-based) of ``total_steps``.

    SpecForge's schedule, edges included: the horizons are whole steps, W = int(warmup_frac * T)
    and R = int(ramp_frac * T); steps 0 .. W-1 weigh 0, ramp step j = 1 .. R (step W + j - 1)
    weighs alpha * j / R, and every later step alpha (without a ramp: alpha from step W on):
    alpha * clip((step - W + 1) / R, 0, 1). Why this edge: a warm-up of W steps then holds exactly
    W steps at 0 (warmup_frac 0 trains the selector from the first step), the ramp's R steps end
    on alpha, and a recipe ported from SpecForge gets the same weight at every step. (The
    continuous form clip((step - W T) / (R T)) holds one more step at 0 and reaches alpha one
    step later; with fractional horizons it differs by up to ~0.16 alpha.)"""
    start, ramp = int(warmup_frac * total_steps), int(ramp_frac * total_steps)
    if ramp <= 0:
        return alpha if step >= start else 0.0
    return alpha * min(1.0, max(0.0, (step - start + 1) / ramp))


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores (same bits)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_hash(seed: int, sample_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Counter-based uniforms [B, length] in [0, 1): splitmix64 of (seed, sample id, position).

    The anchors of a sample then depend only on (seed, sample id), not on which batch, rank or
    world size it lands in -- so 2 ranks x batch b draw exactly what 1 rank x batch 2b draws,
    and a resumed run redraws exactly, with no generator state to checkpoint.
    """
    pos = torch.arange(length, device=sample_ids.device, dtype=torch.int64)
    z = sample_ids.to(torch.int64).unsqueeze(1) * _signed(0xD1B54A32D192ED03) + pos * _signed(0x8CB92BA72F3D8DD7)
    z = z + _signed(seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019)
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double().mul_(2.0**-53).float()


def sample_anchors(
    loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int, seed: int, sample_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to ``num_anchors`` distinct anchors per sequence, uniformly, without a host sync.

    Candidates are positions a with loss_mask[a] == 1 and a + 1 < length. ``seed`` changes every
    step (the trainer mixes its seed with the step); ``sample_ids`` [B] are the samples' dataset
    indices (default 0..B-1). Returns anchors [B, N] sorted ascending and valid [B, N] bool,
    N = max(1, min(num_anchors, S - 1)) (``anchor_slots``: no sequence of at most S tokens has more
    candidates, and the batch plan's row budget counts exactly N x block_size rows per sequence);
    a sequence with fewer candidates than N gets invalid padding anchors (position 0, valid False)
    after its real ones.
    """
    b, s = loss_mask.shape
    n = int(anchor_slots(s, num_anchors))
    if sample_ids is None:
        sample_ids = torch.arange(b, device=loss_mask.device)
    pos = torch.arange(s, device=loss_mask.device)
    candidate = (loss_mask != 0) & (pos.unsqueeze(0) + 1 < lengths.unsqueeze(1))
    scores = torch.where(candidate, uniform_hash(seed, sample_ids, s), torch.full((b, s), -1.0, device=pos.device))
    top, index = scores.topk(n, dim=1)  # a random subset of the candidates, padded by -1 scores
    valid = top >= 0
    anchors = torch.where(valid, index, torch.zeros_like(index))
    # Sort valid anchors ascending (invalid ones last) for a deterministic, cache-friendly layout.
    key = torch.where(valid, anchors, torch.full_like(anchors, s))
    key, order = key.sort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, N] anchors -> [B, N, bs] absolute positions anchor + k."""
    return anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """[B, N, bs] block tokens: the anchor's token at slot 0, MASK everywhere else."""
    b, n = anchors.shape
    out = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :, 0] = input_ids.gather(1, anchors)
    return out


def block_labels_and_weights(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels [B, N, bs] and weights [B, N, bs] (float32).

    w[k] = [k > 0] * valid * loss_mask[a + k] * [a + k < length] * exp(-(k - 1) / gamma).
    Labels past the sequence end are 0 (their weight is 0).
    """
    s = input_ids.shape[1]
    pos = block_positions(anchors, block_size)  # [B, N, bs]
    inside = pos < lengths.view(-1, 1, 1)
    safe = pos.clamp(max=s - 1).flatten(1)
    labels = torch.where(inside, input_ids.gather(1, safe).view_as(pos), torch.zeros_like(pos))
    supervised = loss_mask.gather(1, safe).view_as(pos) != 0
    k = torch.arange(block_size, device=input_ids.device, dtype=torch.float32)
    decay = torch.exp(-(k - 1) / gamma) if gamma is not None else torch.ones_like(k)
    decay[0] = 0.0  # slot 0 is the anchor itself: never scored
    weights = (inside & supervised & valid.unsqueeze(-1)).float() * decay
    return labels, weights


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [B, N, bs] bool: argmax == label (greedy would propose it)
    scored: torch.Tensor  # [B, N, bs] bool: weight > 0
    weight_sum: torch.Tensor  # scalar: sum of this micro-batch's weights
    total: torch.Tensor  # scalar, detached: sum(w * CE) of this micro-batch (the base term; DFlash2's selector apart)
    selector_total: torch.Tensor | None = None  # DFlash2: the selector term's sum, detached, before its alpha
    recall: torch.Tensor | None = None  # DFlash2: [B, N, bs] bool, the label among the slot's candidates

    @property
    def terms_total(self) -> torch.Tensor:
        """Every term's detached sum added up (DFlash2's selector term before its alpha): finite
        exactly when each term is (scalar, on the device)."""
        return self.total if self.selector_total is None else self.total + self.selector_total

    def position_accuracy(self) -> torch.Tensor:
        """[bs - 1] accuracy of slots 1..bs-1 over scored slots (stays on device)."""
        hits = (self.correct & self.scored).flatten(0, 1).sum(0)[1:].float()
        count = self.scored.flatten(0, 1).sum(0)[1:].float()
        return hits / count.clamp(min=1)

    def simulated_tau(self) -> torch.Tensor:
        """Expected acceptance length 1 + sum_k prod_{j<=k} acc_j from per-position accuracy."""
        return 1 + self.position_accuracy().cumprod(0).sum()


def dflash_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 0,
    normalizer: torch.Tensor | None = None,
    slot_loss: SlotLoss | None = None,
    selector=None,
    selector_loss: SelectorLoss | None = None,
    teacher: Teacher | None = None,
) -> LossOutput:
    """Weighted CE of the target's LM head over block slots: sum(w * CE) / normalizer.

    ``slot_loss`` (default: CE) may replace the CE by TV or the LK mix, and with its
    ``dpace_alpha`` the ``weights`` are each slot's 0/1 validity and the loss is weighted by the
    detached D-PACE weights of its block (``dpace_weights``); the default normalizer,
    sum(weights), is then the count of scored slots -- known before the forward, so the
    trainer's global normaliser keeps every split of a batch exact. Its ``auf_factor``
    (accept-until-fail) weighs each block's slots after its first miss by that factor, from the
    head's argmax; the normaliser stays the weight sum before it (known before the forward).
    ``teacher`` (SoftLabels.teacher, rows aligned with ``hidden``'s slots) makes each slot's
    base loss the soft-label mix of CE and the KL from the target's distribution.

    hidden [B, N, bs, H] (drafter output after its final norm), or [B, N, bs - 1, H] for
    slots 1..bs-1 only (``drafter(..., scored_only=True)``: slot 0's weight is always 0, so
    the loss is the same); head_weight [V, H] the target's frozen LM head; labels/weights
    [B, N, bs]; ``correct`` is [B, N, bs] either way (False at an unscored slot 0). ``normalizer`` defaults to sum(w);
    the trainer passes the GLOBAL sum over ranks, micro-batches and anchor slices so that any
    split of a batch gives the same gradient. With ``chunk_size`` > 0 the head and CE run over
    chunks of that many slots, each chunk's gradient computed on the spot (head_kernels.head_ce),
    so [N*bs, V] logits never exist at once: peak is one chunk's [chunk, V] fp32 logits; loss and
    gradients equal the unchunked ones (tested), at no extra FLOPs.

    DFlash2: ``selector`` (the drafter's CandidateSelector) with ``selector_loss`` adds the
    selector term (SelectorLoss) on the head's top-k candidates of each row, which the head's
    pass also returns; ``correct`` is then the selector's teacher-forced pick (what a greedy walk
    proposes along an accepted prefix) and ``recall`` whether the label was a candidate.
    """
    shape = labels.shape
    skip = shape[2] - hidden.shape[2]  # 1: slot 0 was not computed
    if skip not in (0, 1):
        raise ValueError(f"hidden has {hidden.shape[2]} slots per block for {shape[2]} labels: expected bs or bs - 1")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels[:, :, skip:].reshape(-1)
    w = weights[:, :, skip:].reshape(-1)
    slot_loss = slot_loss or SlotLoss()
    rows_fn = None
    if not slot_loss.plain:
        slots = shape[2] - skip

        def rows_fn(base: torch.Tensor, ce: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return slot_loss.rows(base, ce, correct, w, slots)  # rows [B * N blocks, slots], block-major
    top_k = selector.top_k if selector is not None and selector_loss is not None else 0
    total, correct, ce, top = head_ce(h, head_weight, y, w, chunk_size, rows_fn, top_k,
                                      top_k and selector_loss.stop_gradient, teacher)
    selector_total = recall = None
    base = total
    if top_k:
        previous = torch.cat([labels[:, :, :1], labels[:, :, :-1]], dim=2)[:, :, skip:].reshape(-1)
        selector_total, correct, recall = _selector_term(selector, selector_loss, h, previous, y, w, ce, top,
                                                         slot_loss, shape[2] - skip)
        total = total + selector_loss.alpha * selector_total
        recall = F.pad(recall.view(*shape[:2], -1), (skip, 0), value=False)
    correct = correct.view(*shape[:2], -1)
    if skip:
        correct = F.pad(correct, (1, 0), value=False)
    weight_sum = w.sum()  # of the slots scored here (slot 0's weight is 0 by convention)
    if normalizer is None:
        normalizer = weight_sum
    return LossOutput(
        loss=total / normalizer.clamp(min=1e-6),
        correct=correct,
        scored=(weights > 0),
        weight_sum=weight_sum,
        total=base.detach(),
        selector_total=None if selector_total is None else selector_total.detach(),
        recall=recall,
    )


def _selector_term(selector, spec: SelectorLoss, hidden: torch.Tensor, previous: torch.Tensor, labels: torch.Tensor,
                   weights: torch.Tensor, ce: torch.Tensor, top, slot_loss: SlotLoss, slots: int):
    """(sum_k w_k hit_k CE(scores_k, j*_k), the selector's pick == label, label among the
    candidates), each over rows [R] of ``slots`` slots per block (SelectorLoss)."""
    unary, candidates = top
    if spec.stop_gradient:
        hidden, unary = hidden.detach(), unary.detach()
    scores = selector.scores(hidden, previous, candidates, unary).float()
    hit = candidates == labels.unsqueeze(1)
    recall = hit.any(1)
    strict = F.cross_entropy(scores, hit.to(torch.uint8).argmax(1), reduction="none") * recall  # misses add nothing
    w = slot_loss.slot_weights(ce, weights, slots)  # the base term's weights (D-PACE: from the full block)
    picked = candidates.gather(1, scores.detach().argmax(1, keepdim=True)).squeeze(1)
    return (w * strict).sum(), picked == labels, recall


@dataclass
class Blocks:
    """The anchored blocks of one micro-batch: everything the loss needs except the model."""

    anchors: torch.Tensor  # [B, N] positions, sorted
    valid: torch.Tensor  # [B, N] bool
    input_ids: torch.Tensor  # [B, N, bs] anchor token then MASK
    labels: torch.Tensor  # [B, N, bs] same-position labels
    weights: torch.Tensor  # [B, N, bs] float32: the decay weights, or (D-PACE) each slot's 0/1 validity
    loss: SlotLoss = SlotLoss()  # what each slot contributes (CE, TV, LK), D-PACE-weighted or not
    selector: SelectorLoss | None = None  # DFlash2's selector term at this step (None: no selector term)

    @property
    def dpace_alpha(self) -> float | None:
        """D-PACE's alpha when the loss weights each block from its CE (dpace_weights), else None."""
        return self.loss.dpace_alpha

    @property
    def weight_sum(self) -> torch.Tensor:
        return self.weights.sum()

    def _per_block(self, fn) -> Blocks:
        """These blocks with ``fn`` applied to each per-block field [B, N, ...] (same losses)."""
        return Blocks(*(fn(t) for t in (self.anchors, self.valid, self.input_ids, self.labels, self.weights)),
                      self.loss, self.selector)

    def shard(self, index: int, count: int) -> Blocks:
        """Share ``index`` of ``count`` of the anchor axis, contiguous (the ranks of a tensor-
        parallel target group each train on one; together they hold every block once). The axis
        is padded with invalid blocks (weight 0) to a multiple of ``count`` first, so every share
        has the same number of blocks."""
        if count == 1:
            return self
        n = self.anchors.shape[1]
        per = -(-n // count)
        pad, part = per * count - n, slice(index * per, (index + 1) * per)

        def padded_share(t: torch.Tensor) -> torch.Tensor:  # padding zeros: anchor 0, invalid, weight 0
            return torch.cat([t, t.new_zeros((t.shape[0], pad, *t.shape[2:]))], dim=1)[:, part]

        return self._per_block(padded_share)

    def slices(self, anchors_per_slice: int) -> list[Blocks]:
        """Split along the anchor axis (0: no split); forward+backward per slice bounds memory."""
        n = self.anchors.shape[1]
        if anchors_per_slice <= 0 or anchors_per_slice >= n:
            return [self]
        return [self._per_block(lambda t, i=i: t[:, i : i + anchors_per_slice]) for i in range(0, n, anchors_per_slice)]


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    num_anchors: int,
    gamma: float | None,
    seed: int,
    sample_ids: torch.Tensor | None = None,
    loss: SlotLoss | None = None,
    selector: SelectorLoss | None = None,
) -> Blocks:
    """Draw anchors and build block inputs, labels and weights for a padded micro-batch [B, S].
    ``loss``: what each slot contributes (default: CE with the decay weights); under D-PACE
    (``loss.dpace_alpha``) ``gamma`` is not used. ``selector``: DFlash2's selector term."""
    loss = loss or SlotLoss()
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors, seed, sample_ids)
    labels, weights = block_labels_and_weights(input_ids, loss_mask, lengths, anchors, valid, block_size,
                                               None if loss.dpace_alpha is not None else gamma)
    return Blocks(anchors, valid, block_input_ids(input_ids, anchors, block_size, mask_token_id), labels, weights,
                  loss, selector)
