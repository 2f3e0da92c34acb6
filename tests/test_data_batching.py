"""Batch plan and BatchSampler: coverage, budget, determinism, rank split, resume."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdraft.data.batching import (
    BatchSampler,
    DrafterRows,
    anchor_slots,
    budget_fill,
    build_batches,
    padding_waste,
    plan_steps,
)


def lengths_strategy():
    return st.lists(st.integers(1, 300), min_size=1, max_size=400).map(lambda x: np.array(x, dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy(), extra=st.integers(0, 2000), max_bs=st.integers(1, 64),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_plan_covers_each_sample_once_within_budget(lengths, extra, max_bs, seed, epoch):
    budget = int(lengths.max()) + extra
    plan = build_batches(lengths, token_budget=budget, max_batch_size=max_bs, seed=seed, epoch=epoch)
    flat = np.concatenate(plan)
    assert np.array_equal(np.sort(flat), np.arange(len(lengths)))
    for b in plan:
        assert 1 <= len(b) <= max_bs and len(b) * lengths[b].max() <= budget
    again = build_batches(lengths, token_budget=budget, max_batch_size=max_bs, seed=seed, epoch=epoch)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again)) and len(plan) == len(again)
    assert 0.0 <= padding_waste(lengths, plan) < 1.0
    assert 0.0 < budget_fill(lengths, plan, budget) <= 1.0


def test_plan_differs_across_epochs_and_seeds():
    lengths = np.random.default_rng(0).integers(1, 500, 2000)
    plans = [build_batches(lengths, token_budget=2048, max_batch_size=16, seed=s, epoch=e)
             for s, e in [(0, 0), (0, 1), (1, 0)]]

    def key(plan):
        return [tuple(b.tolist()) for b in plan]

    assert key(plans[0]) != key(plans[1]) and key(plans[0]) != key(plans[2])
    assert len(plans[0]) == len(plans[1])  # same number of batches every epoch


def test_bucketing_keeps_padding_low():
    lengths = np.random.default_rng(0).lognormal(5, 1, 20_000).astype(np.int64).clip(1, 4096)
    plan = build_batches(lengths, token_budget=16384, max_batch_size=64, seed=0, epoch=0)
    assert padding_waste(lengths, plan) < 0.05


def test_over_budget_sample_names_fix():
    with pytest.raises(ValueError, match=r"sample 2 has 900 tokens.*raise data.token_budget.*data.max_length"):
        build_batches([5, 6, 900], token_budget=512, max_batch_size=4, seed=0, epoch=0)


def collect(sampler_args, world_size, epochs=1, resume_after=None, new_world=None):
    """Run all ranks in lockstep; optionally stop after `resume_after` steps and resume with new_world ranks."""
    samplers = [BatchSampler(**sampler_args, rank=r, world_size=world_size, num_epochs=epochs)
                for r in range(world_size)]
    its = [iter(s) for s in samplers]
    out = []  # (epoch, step, rank, indices)
    step = 0
    while True:
        if resume_after is not None and step == resume_after:
            state = samplers[0].state_dict()
            assert all(s.state_dict() == state for s in samplers)
            samplers = [BatchSampler(**sampler_args, rank=r, world_size=new_world, num_epochs=epochs)
                        for r in range(new_world)]
            for s in samplers:
                s.load_state_dict(state)
            its = [iter(s) for s in samplers]
            resume_after = None
        items = [next(it, None) for it in its]
        if items[0] is None:
            assert all(i is None for i in items)  # every rank ends together
            return out, samplers
        assert len({(e, s) for e, s, _ in items}) == 1
        out += [(e, s, r, idx) for r, (e, s, idx) in enumerate(items)]
        step += 1


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy(), world=st.integers(1, 8), seed=st.integers(0, 1000))
def test_ranks_cover_epoch_once_with_equal_counts(lengths, world, seed):
    args = dict(lengths=lengths, token_budget=int(lengths.max()) * 2, max_batch_size=8, seed=seed)
    out, samplers = collect(args, world, epochs=2)
    for epoch in range(2):
        got = [idx for e, _, _, idx in out if e == epoch]
        per_rank = [sum(1 for e, _, r, _ in out if e == epoch and r == k) for k in range(world)]
        dropped = samplers[0].dropped.get(epoch, 0)
        assert len(set(per_rank)) == 1
        if not dropped:
            assert per_rank[0] == -(-samplers[0].num_global_batches // world)
        flat = np.concatenate(got) if got else np.zeros(0, np.int64)
        assert len(flat) + dropped == len(lengths) and len(np.unique(flat)) == len(flat)
        for idx in got:
            assert len(idx) * lengths[idx].max() <= args["token_budget"]


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy(), world=st.integers(1, 6), new_world=st.integers(1, 6), data=st.data())
def test_resume_reproduces_remaining_batches(lengths, world, new_world, data):
    args = dict(lengths=lengths, token_budget=int(lengths.max()) * 3, max_batch_size=6, seed=7)
    full, _ = collect(args, world, epochs=2)
    steps = len({(e, s) for e, s, _, _ in full})
    cut = data.draw(st.integers(0, steps))
    resumed, _ = collect(args, world, epochs=2, resume_after=cut, new_world=world)
    assert [(e, s, r, i.tolist()) for e, s, r, i in resumed] == [(e, s, r, i.tolist()) for e, s, r, i in full]
    # A different world size re-splits what is left: with the steps done before the cut, every
    # sample of epoch 0 is trained on exactly once (or counted as dropped).
    steps0 = len({s for e, s, _, _ in full if e == 0})
    cut0 = min(cut, steps0)
    other, samplers = collect(args, world, epochs=1, resume_after=cut0, new_world=new_world)
    flat = np.concatenate([i for *_, i in other]) if other else np.zeros(0, np.int64)
    if 0 < cut0 == steps0:  # epoch 0 finished before the resume: any drop happened at the old world size
        plan0 = build_batches(lengths, token_budget=args["token_budget"], max_batch_size=6, seed=7, epoch=0)
        dropped = plan_steps(plan0, world)[1]
    else:
        dropped = samplers[0].dropped.get(0, 0)
    assert len(np.unique(flat)) == len(flat)
    assert len(flat) + dropped == len(lengths)


def test_resume_with_other_world_size_covers_epoch():
    lengths = np.random.default_rng(1).integers(1, 200, 500)
    args = dict(lengths=lengths, token_budget=400, max_batch_size=8, seed=3)
    for world, new_world, cut in [(4, 3, 5), (2, 5, 7), (3, 1, 2)]:
        first = [BatchSampler(**args, rank=r, world_size=world, num_epochs=1) for r in range(world)]
        assert first[0].batches_per_epoch == -(-first[0].num_global_batches // world) == len(first[1])
        its = [iter(s) for s in first]
        seen = []
        for _ in range(cut):
            for it in its:
                seen.append(next(it)[2])
        state = first[0].state_dict()
        assert state["consumed"] == cut * world and state["epoch"] == 0
        rest = [BatchSampler(**args, rank=r, world_size=new_world, num_epochs=1) for r in range(new_world)]
        counts = []
        for s in rest:
            s.load_state_dict(state)
            batches = [idx for _, _, idx in s]
            counts.append(len(batches))
            seen += batches
        assert len(set(counts)) == 1
        flat = np.concatenate(seen)
        dropped = sum(rest[0].dropped.values())
        assert len(flat) == len(np.unique(flat)) == len(lengths) - dropped


def _count_left(args, world, epochs, cut, new_world):
    """(batches_left as predicted at the cut, batches the resumed sampler then really yields)."""
    first = BatchSampler(**args, rank=0, world_size=world, num_epochs=epochs)
    it = iter(first)
    for _ in range(cut):
        next(it)
    resumed = BatchSampler(**args, rank=0, world_size=new_world, num_epochs=epochs)
    resumed.load_state_dict(first.state_dict())
    predicted = resumed.batches_left(epochs)
    return predicted, sum(1 for _ in resumed)


@pytest.mark.parametrize("seed", range(12))
def test_batches_left_counts_each_later_epoch_as_planned(seed):
    # Single-sample batches at the end of the plan: whether the remainder rule must drop one
    # depends on each epoch's shuffle, so epochs differ in length; the budget a resume recounts
    # from this must be exactly what the sampler yields (an overcount ends the run short of its
    # last steps, an undercount leaves planned samples untrained).
    args = dict(lengths=np.array([6] * 40 + [4] * 2), token_budget=10, max_batch_size=8, seed=seed)
    per_epoch = {len(plan_steps(build_batches(**args, epoch=e), 2)[0]) for e in range(6)}
    for cut, new_world in [(0, 2), (5, 2), (5, 3), (25, 1)]:
        predicted, actual = _count_left(args, 2, 6, cut, new_world)
        assert predicted == actual, (cut, new_world, per_epoch)


def test_plan_steps_splits_tail_instead_of_dropping():
    batches = [np.arange(i * 4, i * 4 + 4) for i in range(5)]
    steps, dropped = plan_steps(batches, 4)
    assert dropped == 0 and [e for e, _ in steps] == [4, 1] and all(len(b) == 4 for _, b in steps)
    assert sorted(np.concatenate([x for _, b in steps for x in b]).tolist()) == list(range(20))
    # One sample per batch: the tail cannot be split -- dropped and counted.
    steps, dropped = plan_steps([np.array([i]) for i in range(5)], 4)
    assert dropped == 1 and [e for e, _ in steps] == [4]
    # The last entry alone is too small, but with the 4 before it two steps of 4 work.
    batches = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]), np.array([6, 7]), np.array([8])]
    steps, dropped = plan_steps(batches, 4)
    assert dropped == 0 and len(steps) == 2 and sum(e for e, _ in steps) == 5


def test_load_state_dict_rejects_other_plan():
    s = BatchSampler([5, 6, 7], token_budget=20, max_batch_size=2, seed=0)
    state = s.state_dict()
    t = BatchSampler([5, 6, 7], token_budget=20, max_batch_size=2, seed=1)
    with pytest.raises(ValueError, match=r"train.seed 0 but this run has 1.*restore train.seed=0"):
        t.load_state_dict(state)


# ---- the drafter's row budget (DrafterRows) --------------------------------------------------------


def _max_rows(plan, lengths, rows: DrafterRows) -> int:
    """The most drafter rows any micro-batch of ``plan`` computes: B x anchor slots x block size."""
    return max(len(b) * int(rows.per_sequence(lengths[b].max())) for b in plan)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=300).map(np.array),
       num_anchors=st.integers(1, 1024), block_size=st.integers(2, 32), slack=st.integers(0, 200_000),
       max_bs=st.integers(1, 64), seed=st.integers(0, 2**31), epoch=st.integers(0, 9))
def test_rows_per_micro_batch_never_exceed_the_row_budget(lengths, num_anchors, block_size, slack, max_bs, seed,
                                                          epoch):
    lengths = lengths.astype(np.int64)
    rows = DrafterRows(int(DrafterRows(1, num_anchors, block_size).per_sequence(lengths.max())) + slack,
                       num_anchors, block_size)
    token_budget = int(lengths.max()) * 8
    plan = build_batches(lengths, token_budget=token_budget, max_batch_size=max_bs, seed=seed, epoch=epoch, rows=rows)
    assert np.array_equal(np.sort(np.concatenate(plan)), np.arange(len(lengths)))
    assert _max_rows(plan, lengths, rows) <= rows.budget
    for b in plan:
        assert 1 <= len(b) <= max_bs and len(b) * lengths[b].max() <= token_budget


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy(), num_anchors=st.integers(1, 400), seed=st.integers(0, 1000),
       epoch=st.integers(0, 5))
def test_plan_unchanged_where_the_row_budget_does_not_bind(lengths, num_anchors, seed, epoch):
    args = dict(token_budget=int(lengths.max()) * 4, max_batch_size=16, seed=seed, epoch=epoch)
    unbounded = build_batches(lengths, **args)
    rows = DrafterRows(1, num_anchors, 8)
    rows = DrafterRows(_max_rows(unbounded, lengths, rows), num_anchors, 8)  # just enough for every batch
    bounded = build_batches(lengths, **args, rows=rows)
    assert [b.tolist() for b in bounded] == [b.tolist() for b in unbounded]
    if rows.budget > int(rows.per_sequence(lengths.max())):  # one row fewer binds somewhere: another plan
        tighter = build_batches(lengths, **args, rows=DrafterRows(rows.budget - 1, num_anchors, 8))
        assert _max_rows(tighter, lengths, rows) < rows.budget
        assert [b.tolist() for b in tighter] != [b.tolist() for b in unbounded]


def test_row_budget_bounds_short_sequences_the_token_budget_lets_through():
    # The worst case: short chats. 64 sequences of 300 tokens fit 16384 tokens, but would
    # carry 64 x 299 anchors x 16 = 306K drafter rows; the row budget keeps 3 per micro-batch.
    lengths = np.full(648, 300)
    rows = DrafterRows(16384, 512, 16)
    plan = build_batches(lengths, token_budget=16384, max_batch_size=64, seed=0, epoch=0, rows=rows)
    assert {len(b) for b in plan} == {16384 // (299 * 16)} and _max_rows(plan, lengths, rows) <= 16384
    assert len(build_batches(lengths, token_budget=16384, max_batch_size=64, seed=0, epoch=0)[0]) == 54


def test_anchor_slots_follow_what_a_sequence_can_supply():
    assert anchor_slots(np.array([1, 2, 100, 513, 514, 5000]), 512).tolist() == [1, 1, 99, 512, 512, 512]
    assert DrafterRows(10_000, 512, 16).per_sequence(200) == 199 * 16


def test_sample_over_the_row_budget_names_the_fix():
    with pytest.raises(ValueError, match=r"sample 1 has 900 tokens.*8192 drafter rows.*data.row_budget=4096.*"
                                         r"raise data.row_budget to at least 8192.*objective.num_anchors to 256"):
        build_batches([5, 900, 6], token_budget=1024, max_batch_size=4, seed=0, epoch=0,
                      rows=DrafterRows(4096, 512, 16))


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy(), world=st.integers(1, 4), data=st.data())
def test_resume_with_a_row_budget_reproduces_remaining_batches(lengths, world, data):
    rows = DrafterRows(int(DrafterRows(1, 64, 4).per_sequence(lengths.max())) * 3, 64, 4)
    args = dict(lengths=lengths, token_budget=int(lengths.max()) * 6, max_batch_size=12, seed=3, rows=rows)
    full, _ = collect(args, world, epochs=2)
    for _, _, _, idx in full:
        assert len(idx) * rows.per_sequence(lengths[idx].max()) <= rows.budget
    cut = data.draw(st.integers(0, len({(e, s) for e, s, _, _ in full})))
    resumed, _ = collect(args, world, epochs=2, resume_after=cut, new_world=world)
    assert [(e, s, r, i.tolist()) for e, s, r, i in resumed] == [(e, s, r, i.tolist()) for e, s, r, i in full]


def test_cursor_refuses_another_row_budget_and_one_saved_before_it_that_it_would_change():
    lengths = np.full(40, 300)
    bound = DrafterRows(16384, 512, 16)
    saved = BatchSampler(lengths, token_budget=16384, max_batch_size=64, seed=0, rows=bound).state_dict()
    assert (saved["row_budget"], saved["num_anchors"], saved["block_size"]) == (16384, 512, 16)
    other = BatchSampler(lengths, token_budget=16384, max_batch_size=64, seed=0, rows=DrafterRows(8192, 512, 16))
    with pytest.raises(ValueError, match=r"data.row_budget 16384 but this run has 8192.*restore data.row_budget=16384"):
        other.load_state_dict(saved)
    fewer = BatchSampler(lengths, token_budget=16384, max_batch_size=64, seed=0, rows=DrafterRows(16384, 256, 16))
    with pytest.raises(ValueError, match=r"objective.num_anchors 512 but this run has 256.*restore "
                                         r"objective.num_anchors=512"):
        fewer.load_state_dict(saved)
    # A cursor from before the row budget (no such keys): its plan had 40 x 299 x 16 rows in one batch.
    old = {k: v for k, v in saved.items() if k not in ("row_budget", "num_anchors", "block_size")}
    with pytest.raises(ValueError, match="saved without a drafter row budget.*at least 191360"):
        BatchSampler(lengths, token_budget=16384, max_batch_size=64, seed=0, rows=bound).load_state_dict(old)
    BatchSampler(lengths, token_budget=16384, max_batch_size=64, seed=0,
                 rows=DrafterRows(191360, 512, 16)).load_state_dict(old)  # does not bind: the same plan


def test_a_row_budget_below_one_block_is_not_advised_a_num_anchors_that_cannot_fit_it():
    """row_budget=7 with block 8 advised objective.num_anchors=1, which still needs 8 rows."""
    from flashdraft.data.batching import check_row_budget

    with pytest.raises(ValueError) as caught:
        check_row_budget(40, DrafterRows(7, 512, 8), "sample 3")
    assert "raise data.row_budget to at least 312" in str(caught.value)
    assert "one anchor's block alone is drafter.block_size=8 rows: no num_anchors fits" in str(caught.value)
    assert "num_anchors to" not in str(caught.value)
    with pytest.raises(ValueError, match=r"at least 312 or lower objective.num_anchors to 2$"):
        check_row_budget(40, DrafterRows(16, 512, 8), "sample 3")  # two blocks fit: that advice holds
