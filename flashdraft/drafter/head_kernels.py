"""The LM head + cross-entropy kernels of the training loss: the head pass over the drafter's rows.

``head_ce`` is the one entry point (flashdraft.objective's losses call it): the target's frozen LM
head over the drafter's hidden rows, each row's CE against its label (or, with a ``Teacher``, the
soft-label mix of CE and the KL divergence from the target's own distribution), the weighted total
and its gradients, and DFlash2's top-k candidates. In chunks (``_ChunkedHeadCE``) the [rows, V]
logits, the drafter's and the teacher's, never exist at once and every gradient is computed in the
forward's own pass; ``_CandidateLogits`` gives the candidates' logits a backward that keeps no
[R, k, H] gather; ``row_max`` is the fast exact argmax on CPU. What each row's loss contributes
(CE, TV, LK, D-PACE or accept-until-fail weights) is the objective's, passed in as ``rows_fn``.

A module of its own beside ``kernels.py`` (the drafter layers' kernels): these run on the loss's
rows, after the drafter, and import only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashdraft.autocast import autocast_suspended


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max [R, 1] and the index of its FIRST occurrence [R] (argmax's tie rule) of
    x [R, V]. ``x.max(-1)`` gives both, but on CPU its index-tracking reduction is ~4x slower
    than two plain ones: the max of each tile of up to 64 columns, then the first tile holding
    the row max and the first such column in it (4096 columns: 1.34 -> 0.34 ms per 256 rows;
    docs/benchmarks.md). Exact, ties and NaN included."""
    r, v = x.shape
    tile = math.gcd(v, 64)
    if tile < 8 or x.device.type != "cpu":  # odd vocabulary sizes; GPUs reduce with indices at full speed
        top, index = x.max(-1, keepdim=True)
        return top, index.squeeze(1)
    tiles = x.view(r, v // tile, tile)
    tile_max = tiles.amax(-1)
    top = tile_max.amax(-1, keepdim=True)

    def first_hit(t: torch.Tensor) -> torch.Tensor:  # argmax of a uint8 mask: its first 1
        return ((t == top) | t.isnan()).to(torch.uint8).argmax(-1)  # a NaN is the max, as in max(-1)

    first_tile = first_hit(tile_max).unsqueeze(-1)
    within = tiles.gather(1, first_tile.unsqueeze(-1).expand(r, 1, tile)).squeeze(1)
    return top, first_tile.squeeze(1) * tile + first_hit(within)


@dataclass(frozen=True)
class Teacher:
    """Soft labels from the target (knowledge distillation): each row's loss becomes
    (1 - weight) * CE(z, y) + weight * T^2 * KL(p_T || q_T), p_T = softmax(z_t / T) the target's
    distribution over the row's label position and q_T = softmax(z / T) the drafter's, where z_t
    = ``hidden`` @ W^T under the same frozen head: ``hidden`` [R, H] is the target's final normed
    hidden state one position before each row's label (where the target predicted it). The T^2
    keeps the KL's gradient on CE's scale (Hinton et al. 2015)."""

    hidden: torch.Tensor
    temperature: float = 1.0
    weight: float = 1.0


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_t w_t * loss_t(h_t @ W^T, y_t) over chunks of rows, gradients computed in the same pass;
    loss_t is CE, or with a teacher the mix of CE and the KL from the teacher's distribution.

    Each chunk's [chunk, V] fp32 logits live only inside the loop and are turned in place into
    d(sum)/d(logits) = w * (softmax - onehot) (+ the KL's w * T * (q_T - p_T)), then into the chunk's
    grad_h (and grad_W when the head trains) right away: one [chunk, V] buffer, one exp per logit.
    So nothing is recomputed in backward (unlike checkpointing, which runs the head twice) and peak
    memory is one chunk's logits. A teacher takes two more buffers (its logits, then q_T - p_T;
    and p_T), so its rows go a third of a chunk at a time: three buffers of chunk / 3 rows, the
    same peak as CE's one of chunk rows (``bench step --variants fast,kd``, docs/benchmarks.md).
    """

    @staticmethod
    def forward(ctx, h, head_weight, labels, weights, chunk_size, want_grads, rows_fn=None, top_k=0,
                teacher_h=None, temperature=1.0, kd_weight=0.0):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_grads and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(head_weight, dtype=torch.float32) if want_grads and ctx.needs_input_grad[1] else None
        if (rows_fn is not None or teacher_h is not None) and grad_w is not None:
            raise ValueError("D-PACE / accept-until-fail weights, a TV / LK loss or soft labels with a trainable LM "
                             "head: the head's gradient would need a second pass; flashdraft trains against the "
                             "target's frozen head")
        # rows_fn (D-PACE, TV, LK, accept-until-fail): each row's loss depends on every slot's CE
        # or correctness, known only after the loop. Each row's gradient is d loss / d base times
        # its base loss's gradient, so the loop computes those for the scored rows (weight > 0),
        # and scales them once it is known.
        ces, bases, correct, tops = [], [], [], []
        ce_share = 1.0 - kd_weight if teacher_h is not None else 1.0
        if teacher_h is not None:  # three [rows, V] buffers instead of one: a third of the rows each
            chunk_size = max(1, chunk_size // 3)
        # One [chunk, V] logits buffer for every chunk (a fresh multi-MB tensor per chunk costs
        # page faults on CPU); the head's matmul writes straight into it.
        buffer = torch.empty(min(chunk_size, h.shape[0]), head_weight.shape[0], dtype=h.dtype, device=h.device)
        soft = torch.empty_like(buffer, dtype=torch.float32) if teacher_h is not None else None
        teacher_p = torch.empty_like(buffer, dtype=torch.float32) if teacher_h is not None else None
        for start in range(0, h.shape[0], chunk_size):
            part = slice(start, start + chunk_size)
            rows = min(chunk_size, h.shape[0] - start)
            logits = torch.mm(h[part], head_weight.t(), out=buffer[:rows]).float()
            y, w = labels[part], weights[part].float()
            if rows_fn is not None:
                w = (w > 0).float()  # unit gradients of the scored rows: rows_fn's scale carries the weight
            picked = logits.gather(1, y.unsqueeze(1))
            top, best = row_max(logits)
            correct.append(best == y)  # argmax == label, as _unchunked_head_ce
            if top_k:
                tops.append(logits.topk(top_k, dim=-1))  # DFlash2's candidates, before the in-place softmax
            kl = None
            if teacher_h is not None:  # before the in-place softmax below: it reads the logits
                kl = _soft_label_rows(logits, top, teacher_h[part], head_weight, temperature, soft[:rows],
                                      teacher_p[:rows])
            p = logits.sub_(top).exp_()  # in place from here: unnormalised softmax
            z = p.sum(-1, keepdim=True)
            ces.append((top + z.log() - picked).squeeze(1))
            bases.append(ces[-1] if kl is None else ce_share * ces[-1] + kd_weight * temperature ** 2 * kl)
            if rows_fn is None:
                total += (bases[-1] * w).sum()
            if grad_h is not None or grad_w is not None:
                g = p.mul_(w.unsqueeze(1) * ce_share / z)  # w * (1 - lambda) * softmax
                g[torch.arange(g.shape[0], device=g.device), y] -= w * ce_share
                if kl is not None:  # + w * lambda * T * (q_T - p_T), which _soft_label_rows left in soft
                    g.addcmul_(soft[:rows], w.unsqueeze(1), value=kd_weight * temperature)
                g = g.to(h.dtype)
                if grad_h is not None:
                    torch.mm(g, head_weight, out=grad_h[part])
                if grad_w is not None:
                    grad_w += (g.t() @ h[part]).float()
        ce = torch.cat(ces)
        if rows_fn is not None:
            values, scale = rows_fn(torch.cat(bases), ce, torch.cat(correct))
            total = values.sum()
            if grad_h is not None:
                grad_h.mul_(scale.unsqueeze(1).to(grad_h.dtype))
        top_values = torch.cat([t.values for t in tops]) if tops else ce.new_empty(0)
        top_ids = torch.cat([t.indices for t in tops]) if tops else labels.new_empty(0)
        ctx.head_dtype = head_weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        outputs = (torch.cat(correct), ce, top_values, top_ids)
        ctx.mark_non_differentiable(*outputs)
        return (total, *outputs)

    @staticmethod
    def backward(ctx, grad_total, *_):
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h * grad_total.to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * grad_total).to(ctx.head_dtype)
        return gh, gw, None, None, None, None, None, None, None, None, None


def _soft_label_rows(logits: torch.Tensor, top: torch.Tensor, teacher_h: torch.Tensor, head_weight: torch.Tensor,
                     temperature: float, soft: torch.Tensor, teacher_p: torch.Tensor) -> torch.Tensor:
    """Each row's KL(p_T || q_T) [rows] of the drafter's fp32 ``logits`` [rows, V] (row max ``top``)
    against the teacher's distribution from ``teacher_h`` [rows, H]; leaves q_T - p_T in ``soft``
    (the KL's gradient with respect to the logits, divided by T). ``logits`` are only read.

    KL = sum p log p - sum p log q, with log p = t - log Z_t (t the teacher's logits / T, shifted by
    their max) and log q = (z - max z) / T - log Z_q: both sums are row dot products, so the only
    [rows, V] tensors are the two fp32 buffers the caller owns: ``soft`` (t first, then q_T - p_T)
    and ``teacher_p`` (p_T)."""
    teacher_h = teacher_h.to(head_weight.dtype)
    if head_weight.dtype == torch.float32:  # the teacher's logits straight into soft
        t = torch.mm(teacher_h, head_weight.t(), out=soft)
    else:
        t = soft.copy_(torch.mm(teacher_h, head_weight.t()))
    t.div_(temperature)
    t.sub_(t.amax(-1, keepdim=True))  # log-space, shifted: t = log p_T + log Z_t
    p = torch.exp(t, out=teacher_p)
    z_t = p.sum(-1, keepdim=True)
    p.div_(z_t)  # p_T
    p_log_p = torch.einsum("rv,rv->r", p, t) - z_t.squeeze(1).log()
    q = torch.sub(logits, top, out=soft).div_(temperature).exp_()  # t is spent: q_T takes its buffer
    z_q = q.sum(-1, keepdim=True)
    q.div_(z_q)  # q_T
    p_log_q = (torch.einsum("rv,rv->r", p, logits) - top.squeeze(1)) / temperature - z_q.squeeze(1).log()
    q.sub_(p)  # q_T - p_T
    return p_log_p - p_log_q


class _CandidateLogits(torch.autograd.Function):
    """The head's logits of each row's candidates, h_r . W[c] [R, k], given their values (the
    chunked head computed them): the backward is grad_h[r] = sum_j g[r, j] W[c_rj], one
    embedding-bag over the frozen head's rows, so no [R, k, H] gather is kept."""

    @staticmethod
    def forward(ctx, h, head_weight, ids, values):
        ctx.save_for_backward(head_weight, ids)
        ctx.h_dtype = h.dtype
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        head_weight, ids = ctx.saved_tensors
        grad_h = F.embedding_bag(ids, head_weight, per_sample_weights=grad.to(head_weight.dtype), mode="sum")
        return grad_h.to(ctx.h_dtype), None, None, None


def _unchunked_head_ce(hidden, head_weight, labels, weights, rows_fn=None, top_k=0, teacher: Teacher | None = None):
    """The unchunked head: (total, correct, each row's CE detached, the rows' top-k logits [R, k]
    (differentiable) and ids, or None)."""
    logits = F.linear(hidden, head_weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    base = ce
    if teacher is not None:
        t = teacher.temperature
        teacher_logits = F.linear(teacher.hidden.to(head_weight.dtype), head_weight).float()
        kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher_logits / t, -1), log_target=True,
                      reduction="none").sum(-1)
        base = (1 - teacher.weight) * ce + teacher.weight * t ** 2 * kl
    correct = logits.argmax(-1) == labels
    total = rows_fn(base, ce.detach(), correct)[0].sum() if rows_fn is not None else (base * weights).sum()
    top = None
    if top_k:
        ids = logits.detach().topk(top_k, dim=-1).indices
        top = (logits.gather(1, ids), ids)
    return total, correct, ce.detach(), top


def head_ce(h, head_weight, y, w, chunk_size: int, rows_fn, top_k: int, detached_top: bool,
            teacher: Teacher | None = None):
    """The LM head + CE over rows h [R, H] with labels y [R] and weights w [R]: (total, correct [R],
    each row's CE detached, and with ``top_k`` the rows' top-k head logits [R, k] (differentiable
    unless ``detached_top``) with their ids, else None), in chunks of ``chunk_size`` rows
    (_ChunkedHeadCE) or at once. Each row's base loss is its CE, or with ``teacher`` the soft-label
    mix (``Teacher``). The total is sum(w * base), or with ``rows_fn`` ((base [R], CE [R] detached,
    correct [R]) -> each row's loss and d loss / d base) the sum of its rows' losses."""
    if chunk_size <= 0 or (chunk_size >= h.shape[0] and teacher is None):  # soft labels: chunked whenever asked
        return _unchunked_head_ce(h, head_weight, y, w, rows_fn, top_k, teacher)
    head = head_weight
    with autocast_suspended(h.device.type) as dtype:  # its matmuls write into buffers (out=)
        if dtype is not None:
            h, head = h.to(dtype), head.to(dtype)
        soft = (teacher.hidden.detach(), teacher.temperature, teacher.weight) if teacher is not None else ()
        total, correct, ce, values, ids = _ChunkedHeadCE.apply(h, head, y, w, chunk_size, torch.is_grad_enabled(),
                                                               rows_fn, top_k, *soft)
        if not top_k:
            return total, correct, ce, None
        if head.requires_grad:
            raise ValueError("DFlash2's selector term with a trainable LM head: flashdraft trains against the "
                             "target's frozen head")
        return total, correct, ce, (values if detached_top else _CandidateLogits.apply(h, head, ids, values), ids)
