"""Every layout trains what its reference run trains, and a run resumed in another layout goes on
as the uninterrupted one: two matrices, each row a layout (or a resume) and the run it must equal.
The reference runs are trained once per session, however many rows compare with them
(conftest.References): the 1-process run of the same samples per step, or the layout it resumes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest
import torch

from conftest import Finished, final_drafter, overrides, results, run_ranks
from p2p_model import assert_one_way_and_nccl_safe

DFLASH2 = {"drafter__family": "dflash2", "drafter__conv_group_size": 8, "drafter__selector_rank": 8,
           "drafter__selector_top_k": 8}
DISAGGREGATED = {"pipeline__placement": "disaggregated", "pipeline__target_ranks": 1, "train__collective_timeout_s": 60}
# soft labels (the target's final states travel with its taps) and accept-until-fail (per-row weights)
SOFT = {"objective__kd_weight": 0.5, "objective__kd_temperature": 2.0, "objective__accept_until_fail": "true",
        "objective__auf_factor": 0.5}


@dataclass(frozen=True)
class Run:
    """A run of the tiny job: its world size, its overrides (beyond conftest.overrides') and
    whether its device group's p2p ops are recorded."""

    world_size: int = 1
    knobs: dict = field(default_factory=dict)
    p2p: bool = False

    def of(self, references) -> Finished:
        return references(self.world_size, self.p2p, **self.knobs)


# ---- a layout trains what its reference trains ------------------------------------------------


def _ddp(ranks, reference, out):
    r0 = ranks[0]
    assert r0["ddp"] == "DistributedDataParallel" and not r0["target_in_ddp"]


def _sharded_groups(ranks, reference, out):
    """The ranks of a target group compute the same features and split each micro-batch's anchored
    blocks; the gradient normaliser stays global (data-parallel groups: the reference's grad_accum)."""
    (single,) = reference.ranks
    assert all(r["target_sharded"] for r in ranks) and not single["target_sharded"]
    # the ranks of a group split the blocks: together (and with the other group) the 1-process run's
    assert all(0 < a < b for r in ranks for a, b in zip(r["blocks"], single["blocks"]))
    assert [sum(step) for step in zip(*(r["blocks"] for r in ranks))] == single["blocks"]


def _from_a_sharded_target_group(ranks, reference, out):
    """Ranks 2 and 3 form one tensor-parallel target group feeding drafter ranks 0 and 1; its first
    rank sends every step's features once (not once per shard), the other computes them with it."""
    drafters, targets = ranks[:2], ranks[2:]
    assert all(r["target_sharded"] for r in targets) and not any(r["target_sharded"] for r in drafters)
    assert all(not any(r["built"].values()) for r in targets)  # a target rank builds no drafter, optimizer, ...
    # The group's first rank (2) alone sends, one way; rank 3 has no p2p op on the device group.
    ops = assert_one_way_and_nccl_safe(out / "p2p", senders={2, 3})
    assert not [op for op in ops.get(3, []) if op.group == "device"]


def _disaggregated(ranks, reference, out):
    """1 target rank feeding 2 drafter ranks == 2 colocated ranks (same seed, same global batch)."""
    d0, d1, target = ranks
    assert d0["ddp"] == "DistributedDataParallel"
    assert target["losses"] == [] and target["identical"] == []  # the target rank never trains
    # ... and builds nothing a drafter rank trains with (the census sees what a drafter rank builds)
    assert target["built"] == {"DFlashDrafter": 0, "Optimizer": 0, "RunCheckpoints": 0, "Validator": 0}
    assert d0["built"] == {"DFlashDrafter": 1, "Optimizer": 1, "RunCheckpoints": 1, "Validator": 1}
    # The device group carried the features one way (rank 2 -> ranks 0, 1), safe under NCCL's order.
    ops = assert_one_way_and_nccl_safe(out / "p2p", senders={2})
    assert sum(op.kind == "send" and op.group == "device" for op in ops[2]) == 2 * 8 * 4  # 4 tensors per micro-batch
    # The drafter ranks loaded only the target's embedding and LM head (its layers stay on the
    # meta device; with eval data the main one would load it all, to decode); the target rank runs it.
    loaded = [d0["target_layers_loaded"], d1["target_layers_loaded"], target["target_layers_loaded"]]
    assert loaded == [False, False, True]
    step, weights = final_drafter(out)
    assert step == 8
    for name, value in final_drafter(reference.out)[1].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


@dataclass(frozen=True)
class Layout:
    """A layout, the run it must equal, how many of its first ranks train a drafter (and for how
    many steps), and its own assertions: ``check(ranks, reference, out)``."""

    run: Run
    reference: Run
    check: Callable
    drafters: int = 0  # 0: every rank
    steps: int = 6


TP2 = {"target__tensor_parallel": 2}
LAYOUTS = {
    # 2 ranks x micro-batch b == 1 rank x (2 micro-batches of b): the same samples each step. With
    # D-PACE too: its weights depend on the drafter's outputs, its normaliser (the scored-slot count)
    # only on the data. DFlash2 (with D-PACE): the selector, used by the loss outside DDP's forward,
    # is all-reduced like the rest.
    "ddp_decay": Layout(Run(2), Run(1, {"train__grad_accum": 2}), _ddp),
    "ddp_dpace": Layout(Run(2, {"objective__weighting": "dpace"}),
                        Run(1, {"train__grad_accum": 2, "objective__weighting": "dpace"}), _ddp),
    "ddp_dflash2": Layout(Run(2, {"objective__weighting": "dpace", **DFLASH2}),
                          Run(1, {"train__grad_accum": 2, "objective__weighting": "dpace", **DFLASH2}), _ddp),
    "tp2": Layout(Run(2, TP2), Run(1), _sharded_groups),
    "dp2_x_tp2": Layout(Run(4, TP2), Run(1, {"train__grad_accum": 2}), _sharded_groups),
    "disaggregated_from_a_tp2_group": Layout(
        Run(4, {**TP2, "pipeline__placement": "disaggregated", "pipeline__target_ranks": 2}, p2p=True),
        Run(1, {"train__grad_accum": 2}), _from_a_sharded_target_group, drafters=2),
    "disaggregated_soft_labels": Layout(
        Run(3, {**DISAGGREGATED, **SOFT, "train__max_steps": 8, "checkpoint__save_every": 4}, p2p=True),
        Run(2, {**SOFT, "train__max_steps": 8}), _disaggregated, drafters=2, steps=8),
    "ddp_soft_labels": Layout(Run(2, SOFT), Run(1, {"train__grad_accum": 2, **SOFT}), _ddp),
    "disaggregated_1_target_2_drafters": Layout(
        Run(3, {**DISAGGREGATED, "train__max_steps": 8, "checkpoint__save_every": 4}, p2p=True),
        Run(2, {"train__max_steps": 8}), _disaggregated, drafters=2, steps=8),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_trains_what_its_reference_run_trains(references, name):
    """Every drafter rank holds one drafter (bit-identical after every step), they log the same
    losses, and those are the reference's per-step losses (rtol 1e-5)."""
    layout = LAYOUTS[name]
    subject, reference = layout.run.of(references), layout.reference.of(references)
    ranks = subject.ranks
    drafters = ranks[:layout.drafters or len(ranks)]
    assert all(all(r["identical"]) and len(r["identical"]) == layout.steps for r in drafters)
    assert all(r["losses"] == drafters[0]["losses"] for r in drafters)
    np.testing.assert_allclose(drafters[0]["losses"], reference.losses, rtol=1e-5)
    layout.check(ranks, reference, subject.out)


# ---- a run resumed in another layout goes on as the uninterrupted one --------------------------


def _same_run_from_the_checkpoint(straight, ranks, out, at, rtol: float, same_weights: bool):
    """The resumed run trains the uninterrupted one's remaining steps: its losses (to ``rtol``) and,
    when ``same_weights``, its final weights bit for bit."""
    np.testing.assert_allclose(ranks[0]["losses"], straight.losses[at:], rtol=rtol)
    assert len(ranks[0]["losses"]) == len(straight.losses) - at
    if same_weights:
        step, again = final_drafter(out)
        ref_step, weights = final_drafter(straight.out)
        assert step == ref_step
        for name, value in weights.items():
            assert torch.equal(again[name], value), name


def _merged_steps(ranks) -> list:
    """Per optimizer step: [step, lr, the sample ids of every rank]."""
    return [[s, lr, sorted(i for r in ranks for i in r["steps"][k][2])] for k, (s, lr, _) in
            enumerate(ranks[0]["steps"])]


def _epochs(steps, num_samples: int) -> int:
    """The number of whole epochs ``steps`` train, asserting that each is every sample exactly
    once (a step never spans two epochs: each epoch's plan is cut into its own steps)."""
    epochs, seen = 0, set()
    for step, _, ids in steps:
        assert not seen & set(ids) and len(set(ids)) == len(ids), f"step {step} trains a sample twice in an epoch"
        seen |= set(ids)
        if len(seen) == num_samples:
            epochs, seen = epochs + 1, set()
    assert not seen, f"the last epoch trained {len(seen)} of {num_samples} samples"
    return epochs


def _the_samples_left(straight, ranks, out, at, same_samples: bool):
    """The step counter is kept, the budget recounted at the new layout: every sample is trained
    exactly once per epoch across both parts, the LR goes on where it was (no jump) and reaches
    the end of its schedule; with the same samples per step, the uninterrupted run's samples at its
    learning rates, step by step."""
    full, total = _merged_steps(straight.ranks), straight.ranks[0]["total_steps"]
    assert len(full) == total and total >= 8 and 1 < at < total
    part1, part2, total2 = full[:at], _merged_steps(ranks), ranks[0]["total_steps"]
    assert part2[0][0] == at + 1 and part2[-1][0] == total2
    assert _epochs(part1 + part2, 32) == 3  # each of the 32 samples once per epoch, none lost or replayed
    assert part2[0][1] == pytest.approx(full[at][1], rel=1e-12)  # the lr goes on where it was
    lrs = [lr for _, lr, _ in part1 + part2]
    assert all(b <= a + 1e-15 for a, b in zip(lrs[at - 1:], lrs[at:]))  # past warmup: decaying, never jumping
    assert lrs[-1] < 0.1 * max(lrs)  # the schedule reaches its end
    if same_samples:  # the same samples per step: the uninterrupted run's steps exactly
        assert total2 == total and [ids for _, _, ids in part2] == [ids for _, _, ids in full[at:]]
        assert [lr for _, lr, _ in part2] == pytest.approx([lr for _, lr, _ in full[at:]], rel=1e-12)


@dataclass(frozen=True)
class Resume:
    """The uninterrupted run (with a checkpoint at step ``at``), the layout its step-``at``
    checkpoint is resumed in, and how the two are compared: ``check(straight, ranks, out, at)``."""

    straight: Run
    at: int
    then: Run
    check: Callable


EPOCHS = {"train__max_steps": "null", "train__epochs": 3}
RESUMES = {
    # Checkpoints do not depend on T (the target is never saved): the batch plan's world is the
    # number of target groups, 1 both times.
    "1_process_to_tp2": Resume(Run(1, {"checkpoint__save_every": 3}), 3, Run(2, TP2),
                               partial(_same_run_from_the_checkpoint, rtol=1e-5, same_weights=False)),
    # the disaggregated run's step-4 checkpoint on 2 target ranks x 2 drafter ranks (1:1 pairs)
    "disaggregated_1x2_to_2x2": Resume(
        LAYOUTS["disaggregated_1_target_2_drafters"].run, 4,
        Run(4, {**DISAGGREGATED, "pipeline__target_ranks": 2, "train__max_steps": 8}),
        partial(_same_run_from_the_checkpoint, rtol=1e-6, same_weights=True)),
    # the budget belongs to the run, not to its world size (3 epochs, no max_steps)
    "2_ranks_to_1": Resume(Run(2, {**EPOCHS, "checkpoint__save_every": 7}), 7, Run(1, EPOCHS),
                           partial(_the_samples_left, same_samples=False)),
    "2x1_to_1x2": Resume(Run(2, {**EPOCHS, "checkpoint__save_every": 7}), 7, Run(1, {**EPOCHS, "train__grad_accum": 2}),
                         partial(_the_samples_left, same_samples=True)),
    "1_rank_to_2": Resume(Run(1, {**EPOCHS, "checkpoint__save_every": 13}), 13, Run(2, EPOCHS),
                          partial(_the_samples_left, same_samples=False)),
}


@pytest.mark.parametrize("name", RESUMES)
def test_a_run_resumed_in_another_layout_goes_on_as_the_uninterrupted_one(references, forkserver, tmp_path, name):
    case = RESUMES[name]
    straight = case.straight.of(references)
    out = tmp_path / "resumed"
    args = overrides(references.job, out, checkpoint__resume=straight.out / "checkpoints" / f"step_{case.at:08d}",
                     **case.then.knobs)
    workers = run_ranks(forkserver, "train_ranks", json.dumps(args), world_size=case.then.world_size, timeout=300)
    assert all(forkserver.wait(pid, 0) == 0 for pid, _ in workers)
    ranks = results(workers)
    assert ranks[0]["steps"][0][0] == case.at + 1 and ranks[0]["final_step"] == ranks[0]["total_steps"]
    if case.then.knobs.get("target__tensor_parallel"):
        assert all(r["target_sharded"] for r in ranks)
    case.check(straight, ranks, out, case.at)
