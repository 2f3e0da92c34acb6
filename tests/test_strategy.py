"""The per-family strategies (train/strategy.py), on their own: which family trains a drafter, the
blocks a step and an eval train on, the loss each family adds, and the sums each keeps for the log."""

from __future__ import annotations

import pytest
import torch

from conftest import MASK_ID, VOCAB, make_drafter
from flashdraft.config import DRAFTERS, DrafterConfig, ObjectiveConfig
from flashdraft.data.collate import Batch
from flashdraft.drafter import DFlashDrafter
from flashdraft.drafter.dflash2 import DFlash2Modules
from flashdraft.feed.steps import Micro
from flashdraft.train.optim import SchedulePosition
from flashdraft.train.strategy import (
    DFlash2Strategy,
    SelectorStats,
    StepStats,
    Strategy,
    freeze_untrained,
    strategy_for,
)

SEQ = 40


def dflash2_drafter(target, top_k: int = 120) -> DFlashDrafter:
    """A DFlash2 drafter whose selector is far from its no-op start (120 candidates of 300: a fair
    share of the labels is among them, so the selector term is not empty)."""
    drafter = DFlashDrafter.for_target(target, num_layers=1, block_size=4, mask_token_id=MASK_ID,
                                       dflash2=DFlash2Modules(2, 8, 8, top_k))
    drafter.reset_parameters(0.02, torch.Generator().manual_seed(0))
    with torch.no_grad():
        codebook = drafter.candidate_selector.successor_codebook
        codebook.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return drafter


def micro_batches(sizes: list[int], seed: int = 0) -> list[Micro]:
    """Micro-batches of ``sizes`` samples (ids 0, 1, ... in order) of SEQ tokens, the first 6 of
    each unsupervised, as the h2d stage leaves them (device_batch, device_ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (sum(sizes), SEQ), generator=g)
    mask = torch.ones_like(ids, dtype=torch.uint8)
    mask[:, :6] = 0
    micro, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        batch = Batch(ids[rows], mask[rows], torch.ones_like(ids[rows]), torch.full((n,), SEQ))
        sample_ids = torch.arange(start, start + n)
        micro.append(Micro(batch, sample_ids.numpy(), batch, sample_ids))
        start += n
    return micro


def features_of(target, micro: Micro) -> torch.Tensor:
    with torch.no_grad():
        return target.features(micro.device_batch.input_ids, micro.device_batch.attention_mask)


# ---- which family trains a drafter --------------------------------------------------------------


def test_each_drafter_family_config_offers_gets_a_strategy_of_its_own(target):
    drafters = {family: DFlashDrafter.for_target(target, num_layers=1, block_size=4, mask_token_id=MASK_ID,
                                                 dflash2=DFlash2Modules.of(DrafterConfig(family=family)))
                for family in DRAFTERS}
    chosen = {family: type(strategy_for(d, target, ObjectiveConfig())) for family, d in drafters.items()}
    assert chosen == {"dflash": Strategy, "dflash2": DFlash2Strategy}


def test_a_dflash2_drafter_whose_selector_is_frozen_trains_as_dflash(target):
    """selector_alpha 0: no selector term, so DFlash's strategy; and the selector is frozen (no
    gradient would reach it, which DDP refuses), while a trained one and a DFlash drafter stay as
    they are."""
    frozen, trained, plain = dflash2_drafter(target), dflash2_drafter(target), make_drafter(target)
    off = ObjectiveConfig(selector_alpha=0)
    for drafter in (frozen, plain):
        freeze_untrained(drafter, off)
    freeze_untrained(trained, ObjectiveConfig())
    assert type(strategy_for(frozen, target, off)) is Strategy
    assert not any(p.requires_grad for p in frozen.candidate_selector.parameters())
    assert all(p.requires_grad for d in (trained, plain) for p in d.parameters())


# ---- the blocks -----------------------------------------------------------------------------


def test_a_samples_training_blocks_depend_on_the_seed_step_and_sample_only(target):
    drafter = make_drafter(target, block_size=4)
    strategy = strategy_for(drafter, target, ObjectiveConfig(num_anchors=5), seed=7)
    at = SchedulePosition(3, 10)
    whole = strategy.blocks(micro_batches([4]), 3, at)[0]
    halves = strategy.blocks(micro_batches([2, 2]), 3, at)  # the same samples, two micro-batches
    assert torch.equal(torch.cat([h.anchors for h in halves]), whole.anchors)
    assert torch.equal(torch.cat([h.labels for h in halves]), whole.labels)
    next_step = strategy.blocks(micro_batches([4]), 4, at)[0]
    assert not torch.equal(next_step.anchors, whole.anchors)
    reseeded = strategy_for(drafter, target, ObjectiveConfig(num_anchors=5), seed=8)
    assert not torch.equal(reseeded.blocks(micro_batches([4]), 3, at)[0].anchors, whole.anchors)


def test_a_tensor_groups_ranks_share_the_training_blocks_and_each_evaluates_them_all(target):
    drafter = make_drafter(target, block_size=4)
    ranks = [strategy_for(drafter, target, ObjectiveConfig(num_anchors=5), shard=(r, 2)) for r in range(2)]
    alone = strategy_for(drafter, target, ObjectiveConfig(num_anchors=5))
    (micro,) = micro_batches([3])
    whole = alone.blocks([micro], 0, SchedulePosition(0, 1))[0]
    shares = [s.blocks([micro], 0, SchedulePosition(0, 1))[0] for s in ranks]
    assert all(0 < share.anchors.shape[1] < whole.anchors.shape[1] for share in shares)
    together = torch.cat([share.valid for share in shares], dim=1)[:, : whole.valid.shape[1]]
    assert torch.equal(together, whole.valid)
    torch.testing.assert_close(sum(share.weight_sum for share in shares), whole.weight_sum)
    evals = [s.eval_blocks(micro.device_batch, micro.device_ids) for s in (alone, *ranks)]
    assert all(torch.equal(e.anchors, evals[0].anchors) for e in evals)
    assert all(torch.equal(e.weights, evals[0].weights) for e in evals)


def test_dflash2s_selector_weight_follows_its_schedule_and_the_eval_weighs_it_fully(target):
    """Warm-up 2 of 8 steps, ramp 2: SpecForge's edges (objective.selector_schedule); the eval
    always at the full alpha, stop_gradient carried; DFlash's blocks have no selector term."""
    objective = ObjectiveConfig(selector_alpha=0.8, selector_warmup_frac=0.25, selector_ramp_frac=0.25,
                                selector_stop_gradient=True)
    strategy = strategy_for(dflash2_drafter(target), target, objective)
    micro = micro_batches([2])
    alphas = [strategy.blocks(micro, step, SchedulePosition(step, 8))[0].selector.alpha for step in range(8)]
    assert alphas == pytest.approx([0, 0, 0.4, 0.8, 0.8, 0.8, 0.8, 0.8])
    evaluated = strategy.eval_blocks(micro[0].device_batch, micro[0].device_ids).selector
    assert evaluated.alpha == 0.8 and evaluated.stop_gradient
    plain = strategy_for(make_drafter(target, block_size=4), target, objective)
    assert plain.blocks(micro, 0, SchedulePosition(0, 8))[0].selector is None
    assert plain.eval_blocks(micro[0].device_batch, micro[0].device_ids).selector is None


# ---- the loss and the stats -----------------------------------------------------------------


def test_dflash2s_loss_is_dflashs_plus_its_weighted_selector_term(target):
    """The same drafter and blocks: DFlash2's strategy adds alpha x the selector term to the base
    term DFlash's computes, before the normaliser."""
    drafter = dflash2_drafter(target)
    dflash2 = strategy_for(drafter, target, ObjectiveConfig(loss_chunk_size=7))
    dflash = Strategy(drafter, target, ObjectiveConfig(loss_chunk_size=7))
    (micro,) = micro_batches([2])
    features = features_of(target, micro)
    blocks = dflash2.blocks([micro], 0, SchedulePosition(0, 1))[0]
    normalizer = 2 * blocks.weight_sum
    with torch.no_grad():
        base = dflash.forward_loss(drafter, features, blocks, normalizer)
        full = dflash2.forward_loss(drafter, features, blocks, normalizer)
    assert base.selector_total is None and full.selector_total > 0 and full.recall.any()
    torch.testing.assert_close(full.total, base.total)
    alpha = blocks.selector.alpha
    torch.testing.assert_close(full.loss, (base.total + alpha * full.selector_total) / normalizer)
    torch.testing.assert_close(base.loss, base.total / normalizer)


def test_each_family_logs_its_own_terms_and_nothing_before_a_trained_step(target):
    (micro,) = micro_batches([2])
    features = features_of(target, micro)
    at = SchedulePosition(0, 1)
    found = {}
    for strategy in (strategy_for(make_drafter(target, block_size=4), target, ObjectiveConfig()),
                     strategy_for(dflash2_drafter(target), target, ObjectiveConfig())):
        stats = strategy.new_stats(torch.device("cpu"))
        assert stats.reduce_local() == {}  # nothing trained: no loss that would plot as perfect
        blocks = strategy.blocks([micro], 0, at)[0]
        with torch.no_grad():
            outs = [strategy.forward_loss(strategy.drafter, features, part) for part in blocks.slices(2)]
        for out in outs:
            stats.add(out)
        found[type(stats)] = stats.reduce_local(), outs
    (plain, plain_outs), (dflash2, outs) = found[StepStats], found[SelectorStats]
    assert set(plain) == {"loss", "acc", "acc_first", "tau_sim"}
    plain_weight = sum(o.weight_sum for o in plain_outs)
    assert plain["loss"] == pytest.approx(float(sum(o.total for o in plain_outs) / plain_weight))
    assert set(dflash2) == set(plain) | {"selector_loss", "topk_recall"}
    weight = sum(o.weight_sum for o in outs)
    assert dflash2["selector_loss"] == pytest.approx(float(sum(o.selector_total for o in outs) / weight))
    scored = sum(o.scored[..., 1:].sum() for o in outs)
    recalled = sum((o.recall & o.scored).sum() for o in outs)
    assert dflash2["topk_recall"] == pytest.approx(float(recalled / scored))
    assert 0 < dflash2["topk_recall"] < 1
