"""Soft labels (knowledge distillation from the target) and accept-until-fail weights, through the
strategy's forward and loss, against dense references computed from full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB, make_drafter, tiny_qwen3
from flashdraft.config import ObjectiveConfig
from flashdraft.data.collate import Batch
from flashdraft.objective import accept_until_fail
from flashdraft.target import TargetModel
from flashdraft.train.strategy import strategy_for

BS = 4


def _batch():
    """Two samples with right padding (lengths 30 and 21), two assistant turns each (a user turn
    between them unsupervised), blocks anchored near the end clipped by the sample's end."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([30, 21])
    ids = torch.randint(0, VOCAB - 1, (2, 30), generator=g)
    mask = torch.zeros(2, 30, dtype=torch.uint8)
    mask[:, 4:12] = 1  # turn 1
    mask[:, 16:30] = 1  # turn 2 (runs into the padding of sample 1)
    for b, n in enumerate(lengths.tolist()):
        ids[b, n:], mask[b, n:] = 0, 0
    attention = (torch.arange(30) < lengths.unsqueeze(1)).long()
    return Batch(ids, mask, attention, lengths)


def _setup(objective: ObjectiveConfig):
    target = TargetModel(tiny_qwen3(num_layers=4, seed=3), [1, 2], final_state=True)
    drafter = make_drafter(target, num_layers=1, block_size=BS).train()
    strategy = strategy_for(drafter, target, objective, seed=5)
    batch = _batch()
    features = target.features(batch.input_ids, batch.attention_mask)
    blocks = strategy.eval_blocks(batch, torch.arange(2))
    return target, drafter, strategy, batch, features, blocks


def _dense(strategy, target, drafter, features, blocks, kd_weight, temperature, auf_factor=None):
    """The loss from full logits: every slot k >= 1 of every block, its CE against the token at
    a + k, the KL of the target's softmax at a + k - 1 (torch's kl_div), weighted and normalised
    by the blocks' weight sum; accept-until-fail from the full logits' argmax."""
    taps, states = features[..., :drafter.fc.in_features], features[..., drafter.fc.in_features:]
    hidden = strategy.drafter_forward(drafter, taps, blocks, scored_only=False, distinct_rows=False,
                                      attention="dense")  # [B, N, bs, H]
    head = target.lm_head.weight
    logits = (hidden @ head.T).float()[:, :, 1:]  # slots 1 .. bs-1
    target_logits = (states @ head.T).float()  # [B, S, V]
    b_idx = torch.arange(2).view(2, 1, 1)
    positions = (blocks.anchors.unsqueeze(-1) + torch.arange(0, BS - 1)).clamp(max=states.shape[1] - 1)
    teacher = target_logits[b_idx, positions]  # [B, N, bs-1, V]: the target at a + k - 1
    labels, weights = blocks.labels[:, :, 1:], blocks.weights[:, :, 1:]
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    kl = F.kl_div(F.log_softmax(logits / temperature, -1), F.softmax(teacher / temperature, -1),
                  reduction="none").sum(-1)
    base = (1 - kd_weight) * ce + kd_weight * temperature ** 2 * kl
    w = weights
    if auf_factor is not None:
        correct = logits.argmax(-1) == labels
        w = w * accept_until_fail(correct.flatten(0, 1), (weights > 0).flatten(0, 1), auf_factor).view(w.shape)
    return (w * base).sum() / blocks.weights.sum()


@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("kd_weight,temperature", [(1.0, 1.0), (0.5, 2.0)])
def test_soft_label_loss_and_gradients_equal_the_dense_reference(chunk, kd_weight, temperature):
    objective = ObjectiveConfig(num_anchors=6, kd_weight=kd_weight, kd_temperature=temperature,
                                loss_chunk_size=chunk, accept_until_fail=False)
    target, drafter, strategy, batch, features, blocks = _setup(objective)
    assert (blocks.weights.sum(-1) > 0).any() and (blocks.anchors + BS > batch.lengths.view(2, 1)).any()
    out = strategy.forward_loss(drafter, features, blocks)
    grads = torch.autograd.grad(out.loss, list(drafter.parameters()))
    reference = _dense(strategy, target, drafter, features, blocks, kd_weight, temperature)
    ref_grads = torch.autograd.grad(reference, list(drafter.parameters()))
    torch.testing.assert_close(out.loss, reference, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_accept_until_fail_composes_with_soft_labels_through_the_head():
    objective = ObjectiveConfig(num_anchors=6, kd_weight=0.5, kd_temperature=1.5, accept_until_fail=True,
                                auf_factor=0.25, loss_chunk_size=5)
    target, drafter, strategy, batch, features, blocks = _setup(objective)
    out = strategy.forward_loss(drafter, features, blocks)
    reference = _dense(strategy, target, drafter, features, blocks, 0.5, 1.5, auf_factor=0.25)
    torch.testing.assert_close(out.loss, reference, rtol=1e-5, atol=1e-5)
    plain = strategy_for(drafter, target, ObjectiveConfig(num_anchors=6, kd_weight=0.5, kd_temperature=1.5,
                                                          loss_chunk_size=5, accept_until_fail=False), seed=5)
    plain_blocks = plain.eval_blocks(batch, torch.arange(2))
    assert torch.equal(plain_blocks.anchors, blocks.anchors)
    assert float(plain.forward_loss(drafter, features, plain_blocks).loss) > float(out.loss)  # slots were dropped


def test_the_target_appends_its_final_normed_state_only_when_asked():
    model = tiny_qwen3(num_layers=4, seed=3)
    ids = torch.randint(0, VOCAB, (2, 9))
    full = model(ids, output_hidden_states=True).hidden_states
    with_state = TargetModel(model, [1, 2], final_state=True)
    assert with_state.feature_size == 3 * with_state.hidden_size
    features = with_state.features(ids)
    assert torch.equal(features[..., :2 * with_state.hidden_size], TargetModel(model, [1, 2]).features(ids))
    torch.testing.assert_close(features[..., 2 * with_state.hidden_size:], full[-1], rtol=0, atol=0)


def test_soft_labels_are_refused_with_a_hard_label_loss_form():
    with pytest.raises(ValueError, match="objective.loss.*use objective.loss=ce"):
        ObjectiveConfig(kd_weight=0.5, loss="tv")
    with pytest.raises(ValueError, match="objective.kd_temperature"):
        ObjectiveConfig(kd_temperature=2.0)
    with pytest.raises(ValueError, match="objective.auf_factor"):
        ObjectiveConfig(auf_factor=0.5, accept_until_fail=False)
