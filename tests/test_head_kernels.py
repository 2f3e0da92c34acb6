"""The LM head + loss kernels (drafter/head_kernels.py) against dense references."""

import pytest
import torch
import torch.nn.functional as F

from flashdraft.drafter.head_kernels import Teacher, head_ce

R, H, V = 37, 16, 96


def _rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.5
    teacher_h = torch.randn(R, H, generator=g)
    y = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g)
    w[::5] = 0  # rows that are not scored (padding, a clipped block's tail): no loss, no gradient
    return h, head, teacher_h, y, w


def _dense_kd(h, head, teacher_h, y, w, temperature, weight):
    """The soft-label loss from full logits and torch's own kl_div: sum_r w_r [(1 - lambda) CE +
    lambda T^2 KL(p_T || q_T)]."""
    logits, target = h @ head.T, teacher_h @ head.T
    ce = F.cross_entropy(logits, y, reduction="none")
    kl = F.kl_div(F.log_softmax(logits / temperature, -1), F.softmax(target / temperature, -1),
                  reduction="none").sum(-1)
    return (w * ((1 - weight) * ce + weight * temperature ** 2 * kl)).sum()


@pytest.mark.parametrize("chunk", [0, 8, 64])
@pytest.mark.parametrize("temperature,weight", [(1.0, 1.0), (2.0, 0.5), (0.7, 0.25)])
def test_soft_label_loss_and_gradient_equal_the_dense_kl_div(chunk, temperature, weight):
    h, head, teacher_h, y, w = _rows(1)
    h.requires_grad_(True)
    total, correct, ce, _ = head_ce(h, head, y, w, chunk, None, 0, False, Teacher(teacher_h, temperature, weight))
    (grad,) = torch.autograd.grad(total, h)
    ref_h = h.detach().clone().requires_grad_(True)
    reference = _dense_kd(ref_h, head, teacher_h, y, w, temperature, weight)
    (ref_grad,) = torch.autograd.grad(reference, ref_h)
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(grad[w == 0], torch.zeros_like(grad[w == 0]))
    torch.testing.assert_close(ce, F.cross_entropy(h.detach() @ head.T, y, reduction="none"))
    assert torch.equal(correct, (h.detach() @ head.T).argmax(-1) == y)


def test_the_kl_term_vanishes_when_the_teacher_is_the_drafter_and_weight_0_is_plain_ce():
    h, head, _, y, w = _rows(2)
    kl_only = head_ce(h, head, y, w, 8, None, 0, False, Teacher(h, 1.5, 1.0))[0]
    assert abs(float(kl_only)) < 1e-5
    ce_only = head_ce(h, head, y, w, 8, None, 0, False, Teacher(h.flip(0), 1.5, 0.0))[0]
    torch.testing.assert_close(ce_only, head_ce(h, head, y, w, 8, None, 0, False)[0])


@pytest.mark.parametrize("chunk", [0, 8])
def test_soft_labels_compose_with_per_row_weights_known_only_after_the_head(chunk):
    """rows_fn (D-PACE, accept-until-fail) sees each row's base loss, CE and correctness, and scales
    the base loss's gradient; here a weight from the rows' CE, applied to the soft-label base."""
    h, head, teacher_h, y, w = _rows(3)
    teacher = Teacher(teacher_h, 2.0, 0.5)

    def rows_fn(base, ce, correct):
        scale = (w > 0).float() * torch.exp(-ce) * (1 + correct.float())  # detached inputs: a weight
        return scale * base, scale

    h.requires_grad_(True)
    total = head_ce(h, head, y, w, chunk, rows_fn, 0, False, teacher)[0]
    (grad,) = torch.autograd.grad(total, h)
    ref_h = h.detach().clone().requires_grad_(True)
    logits = ref_h @ head.T
    ce = F.cross_entropy(logits, y, reduction="none")
    kl = F.kl_div(F.log_softmax(logits / 2.0, -1), F.softmax(teacher_h @ head.T / 2.0, -1), reduction="none").sum(-1)
    scale = (w > 0).float() * torch.exp(-ce.detach()) * (1 + (logits.detach().argmax(-1) == y).float())
    reference = (scale * (0.5 * ce + 0.5 * 4.0 * kl)).sum()
    (ref_grad,) = torch.autograd.grad(reference, ref_h)
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
