"""Objective conventions: anchors, same-position labels, slot 0, decay and D-PACE weights, loss."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdraft.data.batching import DrafterRows, build_batches
from flashdraft.objective import (
    LossOutput,
    SlotLoss,
    block_input_ids,
    block_labels_and_weights,
    default_gamma,
    dflash_loss,
    dpace_weights,
    make_blocks,
    sample_anchors,
)


def test_anchors_come_only_from_supervised_positions_with_a_next_token():
    loss_mask = torch.zeros(3, 20, dtype=torch.uint8)
    loss_mask[0, 5:15] = 1
    loss_mask[1, 10:20] = 1
    loss_mask[2, :] = 1
    lengths = torch.tensor([20, 14, 20])  # row 1: padding from 14 on
    for seed in range(20):
        anchors, valid = sample_anchors(loss_mask, lengths, 4, seed)
        for b in range(3):
            for a in anchors[b][valid[b]].tolist():
                assert loss_mask[b, a] == 1 and a + 1 < lengths[b]
        assert valid[1].sum() == 3  # only 10, 11, 12 qualify (13 + 1 == length)


def test_anchors_are_distinct_sorted_and_redrawn():
    loss_mask = torch.ones(1, 64, dtype=torch.uint8)
    lengths = torch.tensor([64])
    first, valid = sample_anchors(loss_mask, lengths, 16, seed=0)
    second, _ = sample_anchors(loss_mask, lengths, 16, seed=1)
    assert valid.all()
    assert first[0].tolist() == sorted(set(first[0].tolist()))
    assert not torch.equal(first, second)


def test_too_few_candidates_give_invalid_padding_anchors():
    loss_mask = torch.zeros(1, 10, dtype=torch.uint8)
    loss_mask[0, 3] = 1
    anchors, valid = sample_anchors(loss_mask, torch.tensor([10]), 5, seed=0)
    assert valid.tolist() == [[True, False, False, False, False]]
    assert anchors[0, 0] == 3


def test_anchors_depend_on_the_sample_not_on_its_batch():
    torch.manual_seed(0)
    loss_mask = (torch.rand(4, 50) > 0.3).to(torch.uint8)
    lengths = torch.tensor([50, 44, 50, 37])
    ids = torch.tensor([7, 123, 5, 99])
    together, valid = sample_anchors(loss_mask, lengths, 8, seed=3, sample_ids=ids)
    for half in (slice(0, 2), slice(2, 4)):  # two ranks with half the batch each
        alone, valid_alone = sample_anchors(loss_mask[half, :50], lengths[half], 8, seed=3, sample_ids=ids[half])
        assert torch.equal(alone, together[half]) and torch.equal(valid_alone, valid[half])


def test_anchor_draws_are_uniform_over_candidates():
    loss_mask = torch.ones(1, 10, dtype=torch.uint8)
    counts = torch.zeros(10)
    for seed in range(2000):
        anchors, _ = sample_anchors(loss_mask, torch.tensor([10]), 1, seed)
        counts[anchors[0, 0]] += 1
    assert counts[9] == 0  # a + 1 < length
    assert counts[:9].min() > 2000 / 9 * 0.75 and counts[:9].max() < 2000 / 9 * 1.25


def test_block_input_is_anchor_token_then_masks():
    ids = torch.arange(100, 130).view(1, 30)
    blocks = block_input_ids(ids, torch.tensor([[4, 20]]), 4, mask_token_id=7)
    assert blocks.tolist() == [[[104, 7, 7, 7], [120, 7, 7, 7]]]


def test_labels_are_same_position_not_next_token():
    ids = torch.arange(100, 130).view(1, 30)
    loss_mask = torch.ones_like(ids)
    labels, weights = block_labels_and_weights(
        ids, loss_mask, torch.tensor([30]), torch.tensor([[4]]), torch.tensor([[True]]), 4, gamma=None
    )
    assert labels.tolist() == [[[104, 105, 106, 107]]]  # slot k labelled with the token AT a + k
    assert weights.tolist() == [[[0.0, 1.0, 1.0, 1.0]]]  # slot 0 never scored


def test_decay_weights_for_block_16_gamma_7():
    ids = torch.zeros(1, 64, dtype=torch.long)
    _, weights = block_labels_and_weights(
        ids, torch.ones_like(ids), torch.tensor([64]), torch.tensor([[10]]), torch.tensor([[True]]), 16, gamma=7.0
    )
    expected = [0.0] + [math.exp(-(k - 1) / 7) for k in range(1, 16)]
    assert weights[0, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4


def test_weights_are_zero_past_the_end_where_unsupervised_and_for_padded_blocks():
    ids = torch.arange(20).view(1, 20)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 12] = 0
    labels, weights = block_labels_and_weights(
        ids, loss_mask, torch.tensor([15]), torch.tensor([[10, 3]]), torch.tensor([[True, False]]), 8, gamma=None
    )
    # block at 10: slots 1..4 are positions 11..14; 12 unsupervised; 15.. past the length.
    assert weights[0, 0].tolist() == [0, 1, 0, 1, 1, 0, 0, 0]
    assert labels[0, 0, 5:].tolist() == [0, 0, 0]
    assert weights[0, 1].sum() == 0  # padded block


def test_weighted_ce_and_simulated_tau():
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 4, 8)
    head = torch.randn(11, 8)
    labels = torch.randint(0, 11, (2, 3, 4))
    weights = torch.rand(2, 3, 4)
    weights[..., 0] = 0
    out = dflash_loss(hidden, head, labels, weights)
    ce = torch.nn.functional.cross_entropy((hidden @ head.T).reshape(-1, 11), labels.reshape(-1), reduction="none")
    expected = (ce * weights.reshape(-1)).sum() / weights.sum()
    torch.testing.assert_close(out.loss, expected)
    acc = out.position_accuracy()
    assert acc.shape == (3,)
    tau = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    torch.testing.assert_close(out.simulated_tau(), tau)


def test_simulated_tau_of_a_perfect_drafter_is_the_block_size():
    correct = torch.ones(1, 2, 4, dtype=torch.bool)
    scored = torch.ones(1, 2, 4, dtype=torch.bool)
    out = LossOutput(torch.tensor(0.0), correct, scored, torch.tensor(1.0), torch.tensor(0.0))
    assert out.simulated_tau().item() == 4


def test_chunked_loss_equals_unchunked_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4, 16, requires_grad=True)
    head = torch.randn(97, 16)
    labels = torch.randint(0, 97, (2, 5, 4))
    weights = torch.rand(2, 5, 4)
    full = dflash_loss(hidden, head, labels, weights)
    (grad_full,) = torch.autograd.grad(full.loss, hidden)
    chunked = dflash_loss(hidden, head, labels, weights, chunk_size=7)
    (grad_chunked,) = torch.autograd.grad(chunked.loss, hidden)
    torch.testing.assert_close(chunked.loss, full.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_chunked, grad_full, rtol=1e-5, atol=1e-6)
    assert torch.equal(chunked.correct, full.correct)


@pytest.mark.parametrize("vocab", [4096, 4104, 300, 1000])
def test_row_max_is_max_and_first_argmax_ties_included(vocab):
    """row_max (the chunked CE's tiled max) == x.max(-1): values and the FIRST index of the max."""
    from flashdraft.drafter.head_kernels import row_max

    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(64, vocab, generator=gen)
    x[1] = 0.0  # every column ties: index 0
    x[2, [7, vocab - 3]] = x[2].max() + 1  # a tie in different tiles: the first wins
    x[3, [9, 10]] = x[3].max() + 1  # a tie inside one tile
    x[4] = torch.randint(0, 3, (vocab,), generator=gen).float()  # many ties
    x[5, [11, vocab - 2]] = float("nan")  # max(-1) reports the first NaN
    x[6] = float("-inf")
    top, index = row_max(x)
    expected = x.max(-1)
    torch.testing.assert_close(top.squeeze(1), expected.values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(index, expected.indices)
    assert index[1] == 0 and index[2] == 7 and index[3] == 9


# ---- D-PACE ------------------------------------------------------------------------------
def _dpace_by_hand(q: list[float], valid: list[bool], alpha: float) -> list[float]:
    """DFLASH2.md section 2.1, written out slot by slot."""
    qt = [(1 - alpha) * qk + alpha if v else 1.0 for qk, v in zip(q, valid)]
    c, prod = [], 1.0
    for qk in qt:
        prod *= qk
        c.append(prod)
    return [sum(c[m] for m in range(k, len(q)) if valid[m]) if valid[k] else 0.0 for k in range(len(q))]


def test_dpace_weights_match_the_fact_sheet_vector_and_skip_invalid_slots():
    ce = -torch.log(torch.tensor([[0.8, 0.5, 0.2]]))
    w = dpace_weights(ce, torch.ones(1, 3), 0.5)
    torch.testing.assert_close(w, torch.tensor([[1.98, 1.08, 0.405]]))  # DFLASH2.md's test vector
    # An invalid slot is a no-op in the product and weighs nothing itself.
    w = dpace_weights(ce, torch.tensor([[1.0, 0.0, 1.0]]), 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.9 + 0.54, 0.0, 0.54]]))
    torch.manual_seed(0)
    q, valid = torch.rand(6, 5), torch.rand(6, 5) > 0.3
    w = dpace_weights(-torch.log(q), valid.float(), 0.3)
    for row in range(6):
        torch.testing.assert_close(w[row], torch.tensor(_dpace_by_hand(q[row].tolist(), valid[row].tolist(), 0.3)))
    # alpha 1: every confidence is 1, so w_k = the number of valid slots from k on.
    torch.testing.assert_close(dpace_weights(torch.rand(1, 4), torch.ones(1, 4), 1.0), torch.tensor([[4., 3., 2., 1.]]))


@pytest.mark.parametrize("chunk", [0, 5])  # 5 rows: chunks that cut blocks of 3 scored slots apart
def test_dpace_loss_weights_are_detached_and_normalised_by_the_scored_slot_count(chunk):
    torch.manual_seed(1)
    b, n, bs, h, v = 2, 3, 4, 8, 29
    hidden = torch.randn(b, n, bs - 1, h, requires_grad=True)  # slots 1..bs-1 (scored_only)
    head, labels = torch.randn(v, h), torch.randint(0, v, (b, n, bs))
    valid = (torch.rand(b, n, bs) > 0.25).float()
    valid[:, :, 0] = 0  # slot 0 is the anchor
    out = dflash_loss(hidden, head, labels, valid, chunk_size=chunk, slot_loss=SlotLoss(dpace_alpha=0.5))
    (grad,) = torch.autograd.grad(out.loss, hidden)
    # Independently: per-slot CE, the weights by hand as constants, sum(w * CE) / #scored slots.
    ce = torch.nn.functional.cross_entropy((hidden @ head.t()).reshape(-1, v), labels[:, :, 1:].reshape(-1),
                                           reduction="none").view(b * n, bs - 1)
    q = torch.exp(-ce.detach())
    flags = valid[:, :, 1:].reshape(b * n, bs - 1)
    w = torch.tensor([_dpace_by_hand(q[r].tolist(), (flags[r] > 0).tolist(), 0.5) for r in range(b * n)])
    reference = (w * ce).sum() / flags.sum()
    (grad_ref,) = torch.autograd.grad(reference, hidden, retain_graph=True)
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(grad, grad_ref)
    assert out.weight_sum.item() == flags.sum().item()
    # A gradient through the weights (not detached) would differ: the check above can fail.
    live = torch.exp(-ce)
    qt = torch.where(flags > 0, 0.5 * live + 0.5, torch.ones_like(live))
    c = qt.cumprod(-1) * flags
    (grad_live,) = torch.autograd.grad((c.flip(-1).cumsum(-1).flip(-1) * flags * ce).sum() / flags.sum(), hidden)
    assert not torch.allclose(grad_live, grad_ref)


def test_decay_is_the_default_and_dpace_ignores_gamma():
    ids = torch.randint(0, 50, (1, 40))
    mask, lengths = torch.ones(1, 40, dtype=torch.uint8), torch.tensor([40])
    common = dict(block_size=4, mask_token_id=99, num_anchors=6, seed=3)
    decay = make_blocks(ids, mask, lengths, gamma=2.0, **common)
    dpace = make_blocks(ids, mask, lengths, gamma=2.0, loss=SlotLoss(dpace_alpha=0.5), **common)
    assert decay.dpace_alpha is None and torch.equal(decay.anchors, dpace.anchors)
    torch.testing.assert_close(decay.weights[0, 0], torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert torch.equal(dpace.weights, (decay.weights > 0).float())  # validity only: D-PACE weighs in the loss
    assert all(part.dpace_alpha == 0.5 for part in dpace.slices(2))


# ---- TV and LK ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("kind", ["tv", "lk_lambda"])
@pytest.mark.parametrize("dpace", [None, 0.5])
def test_tv_and_lk_losses_match_their_definitions(chunk, kind, dpace):
    """DFLASH2.md 5.1 for a one-hot target, written out: TV = 1 - q(y); LK^lambda = lambda CE +
    (1 - lambda) TV with lambda = kl_scale exp(-kl_decay a), a = sum(q(y) mask) / sum(mask), detached."""
    torch.manual_seed(2)
    b, n, bs, h, v = 2, 3, 4, 8, 23
    hidden = torch.randn(b, n, bs - 1, h, requires_grad=True)
    head, labels = torch.randn(v, h), torch.randint(0, v, (b, n, bs))
    weights = torch.rand(b, n, bs) * (torch.rand(b, n, bs) > 0.2)
    weights[:, :, 0] = 0
    if dpace is not None:
        weights = (weights > 0).float()
    loss = SlotLoss(kind, dpace, kl_scale=0.8, kl_decay=2.0)
    out = dflash_loss(hidden, head, labels, weights, chunk_size=chunk, slot_loss=loss)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    logits = (hidden @ head.t()).reshape(-1, v)
    ce = torch.nn.functional.cross_entropy(logits, labels[:, :, 1:].reshape(-1), reduction="none")
    q = torch.softmax(logits, -1).gather(1, labels[:, :, 1:].reshape(-1, 1)).squeeze(1)
    w = weights[:, :, 1:].reshape(-1)
    if dpace is not None:
        rows = ce.detach().view(b * n, bs - 1)
        w = dpace_weights(rows, w.view(b * n, bs - 1), dpace).view(-1)
    tv = (w * (1 - q)).sum()
    if kind == "tv":
        reference = tv
    else:
        scored = weights[:, :, 1:].reshape(-1) > 0
        a = q[scored].mean().detach()  # the plain mean over the scored slots, whatever their weights
        lam = 0.8 * torch.exp(-2.0 * a)
        reference = lam * (w * ce).sum() + (1 - lam) * tv
    reference = reference / weights.sum()
    (grad_ref,) = torch.autograd.grad(reference, hidden)
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(grad, grad_ref)


def test_lk_lambda_moves_from_ce_to_tv_as_the_drafter_gets_confident():
    ce = torch.tensor([0.1, 0.2, 3.0])
    w = torch.ones(3)
    right = torch.ones(3, dtype=torch.bool)
    values, scale = SlotLoss("lk_lambda", kl_scale=1.0, kl_decay=0.0).rows(ce, ce, right, w, 3)  # lambda 1: CE
    torch.testing.assert_close(values, ce)
    torch.testing.assert_close(scale, w)
    values, scale = SlotLoss("lk_lambda", kl_scale=0.0).rows(ce, ce, right, w, 3)  # lambda 0: TV
    torch.testing.assert_close(values, 1 - torch.exp(-ce))
    torch.testing.assert_close(scale, torch.exp(-ce))  # d(1 - e^-ce)/d ce


def test_shards_of_the_blocks_partition_them_padded_with_weightless_blocks():
    ids = torch.randint(0, 50, (2, 40))
    mask, lengths = torch.ones(2, 40, dtype=torch.uint8), torch.tensor([40, 31])
    blocks = make_blocks(ids, mask, lengths, block_size=4, mask_token_id=99, num_anchors=7, gamma=2.0, seed=3)
    shards = [blocks.shard(i, 3) for i in range(3)]
    assert [s.anchors.shape[1] for s in shards] == [3, 3, 3]  # 7 blocks padded to 9
    for name in ("anchors", "valid", "input_ids", "labels", "weights"):
        joined = torch.cat([getattr(s, name) for s in shards], dim=1)
        assert torch.equal(joined[:, :7], getattr(blocks, name))
        assert not joined[:, 7:].any()  # the padding: invalid, weightless
    assert sum(s.weight_sum for s in shards) == blocks.weight_sum
    assert blocks.shard(0, 1) is blocks


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_anchors=st.integers(1, 80), block_size=st.integers(2, 16), slack=st.integers(0, 3000))
def test_the_steps_blocks_carry_no_more_rows_than_the_plan_assumed(data, num_anchors, block_size, slack):
    # Random lengths and supervised spans; the plan's batches, padded as the collate pads them,
    # through the step's make_blocks: the rows it builds stay within the row budget, and each
    # sequence gets min(num_anchors, its eligible positions) real anchors.
    n = data.draw(st.integers(1, 40))
    lengths = np.array(data.draw(st.lists(st.integers(1, 200), min_size=n, max_size=n)), dtype=np.int64)
    rows = DrafterRows(int(DrafterRows(1, num_anchors, block_size).per_sequence(lengths.max())) + slack,
                       num_anchors, block_size)
    masks = [np.array(data.draw(st.lists(st.integers(0, 1), min_size=int(s), max_size=int(s))), dtype=np.uint8)
             for s in lengths]
    plan = build_batches(lengths, token_budget=int(lengths.max()) * 8, max_batch_size=32, seed=1, epoch=0, rows=rows)
    for batch in plan:
        s = int(lengths[batch].max())
        mask = torch.zeros(len(batch), s, dtype=torch.uint8)
        for row, i in enumerate(batch.tolist()):
            mask[row, : lengths[i]] = torch.from_numpy(masks[i])
        blk = make_blocks(torch.ones(len(batch), s, dtype=torch.long), mask, torch.from_numpy(lengths[batch]),
                          block_size=block_size, mask_token_id=0, num_anchors=num_anchors, gamma=None, seed=5,
                          sample_ids=torch.from_numpy(batch))
        assert blk.input_ids.shape[:2].numel() * block_size <= rows.budget
        eligible = torch.tensor([int(masks[i][: max(0, lengths[i] - 1)].sum()) for i in batch.tolist()])
        assert blk.valid.sum(1).tolist() == torch.clamp(eligible, max=num_anchors).tolist()


def test_accept_until_fail_drops_the_slots_after_a_blocks_first_miss():
    """Constructed blocks, weights by hand: all right, the first slot wrong, a middle slot wrong,
    an unscored miss (it does not end the block) and a factor instead of 0."""
    from flashdraft.objective import accept_until_fail

    T, F_ = True, False
    correct = torch.tensor([[T, T, T, T], [F_, T, T, T], [T, T, F_, T], [T, F_, T, F_]])
    scored = torch.tensor([[T, T, T, T], [T, T, T, T], [T, T, T, T], [T, F_, T, T]])
    assert accept_until_fail(correct, scored).tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert accept_until_fail(correct, scored, 0.25).tolist() == [[1, 1, 1, 1], [1, .25, .25, .25], [1, 1, 1, .25],
                                                                 [1, 1, 1, 1]]
