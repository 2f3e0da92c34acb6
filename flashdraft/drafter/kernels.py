"""The drafter's small custom-backward kernels and its rotary embedding.

RMSNorm, RoPE and the SwiGLU MLP as autograd Functions that save less and allocate fewer
full-size temporaries than autograd's graph of the same expressions (same values as
transformers' Qwen3 modules; tests/test_step_equivalence.py), and ``use_lean``, the switch
between them and the stock modules. Under autocast they compute as the stock modules would with
weights in the autocast dtype (the bf16-weights path), taking the fp32 master weights as inputs:
their outputs and saved tensors are in that dtype, the weights are cast on the fly (forward and
again in backward, never kept), and their gradients come back in the weights' own dtype.
RotaryEmbedding is Qwen3's, with frequencies that stay fp32 when the drafter is cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from flashdraft.autocast import autocast_suspended


def use_lean(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module`` (RMSNorm, DrafterAttention, DrafterLayer) takes its lean custom-backward
    path for input ``x``: switched on (``lean``) and training, with or without autocast."""
    return module.lean and torch.is_grad_enabled()


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (None: as it is); a floating-point tensor only."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


class _RMSNormFn(torch.autograd.Function):
    """Qwen3's RMSNorm, w * (x * rsqrt(mean(x^2) + eps)), saving x and the per-row scale only
    and computing the backward with two full-size fp32 temporaries for fp32 x (autograd's
    graph keeps x^2 and x * r and makes ~6; lower-precision x adds its fp32 copies). Same
    values (fp32 inside, as Qwen3RMSNorm). ``dtype`` (autocast's, or None): the weight is used
    rounded to it and the output is in it, as Qwen3RMSNorm with a weight in that dtype (under
    autocast the stock module's fp32 weight would promote the output to fp32 [rows, H])."""

    @staticmethod
    def forward(ctx, x, weight, eps, dtype):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, r)
        ctx.dtype = dtype
        out_dtype = dtype or x.dtype
        return _cast(weight, dtype) * (xf * r).to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xhat = x.float() * r
        u = dy.float() * xhat
        dw = u.sum(dim=tuple(range(u.dim() - 1))).to(weight.dtype) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, dw, None, None
        u = torch.mul(dy, _cast(weight, ctx.dtype), out=u)  # dL/dxhat (the weight as the forward used it)
        mean = torch.linalg.vecdot(u, xhat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        dx = xhat.mul_(mean).neg_().add_(u).mul_(r)  # r * (u - xhat * mean(u * xhat))
        return dx.to(x.dtype), dw, None, None


class RMSNorm(Qwen3RMSNorm):
    """Qwen3RMSNorm (same weights and values) with a leaner training backward (_RMSNormFn);
    ``lean = False``: Qwen3RMSNorm's own forward always (the oracle's way)."""

    lean = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_lean(self, x):
            with autocast_suspended(x.device.type) as dtype:
                return _RMSNormFn.apply(x, self.weight, self.variance_epsilon, dtype)
        return super().forward(x)


class _Rope(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin for x [B, H, T, D] and cos / sin [B, T, D], written into
    one output (the plain expression allocates five tensors of x's size); cos / sin get no grad."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ctx.save_for_backward(cos, sin)
        h = x.shape[-1] // 2
        out = x * cos
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        h = dy.shape[-1] // 2
        dx = dy * cos
        dx[..., :h].addcmul_(dy[..., h:], sin[..., h:])
        dx[..., h:].addcmul_(dy[..., :h], sin[..., :h], value=-1)
        return dx, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lean: bool = True) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, D] at the positions of cos / sin [B, T, D] (``lean``:
    one output tensor, in autocast's dtype under autocast; else transformers' expression)."""
    if lean:
        with autocast_suspended(x.device.type) as dtype:
            if dtype is not None:  # elementwise: autocast leaves it alone; an fp32 cos would promote x
                x, cos, sin = _cast(x, dtype), _cast(cos, dtype), _cast(sin, dtype)
            return _Rope.apply(x, cos, sin)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class RotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding whose frequencies stay fp32 when the module is cast (``.to(bf16)``,
    ``.half()``): a cast would round them, and by position 1000 a bf16-rounded frequency is ~1
    radian off, so a drafter cast for inference would rotate q / k unlike training and serving.
    Hugging Face's ``from_pretrained(dtype=...)`` keeps them fp32 the same way (no cast)."""

    def _apply(self, fn, recurse=True):
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            new = self._buffers[name]
            if new.dtype != buf.dtype:  # a cast: the new device, the old dtype
                self._buffers[name] = buf.to(device=new.device)
        return self


class _SwiGLU(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) saving only x, gate(x) and up(x): the [T, I] silu(gate) and
    product that autograd would also keep are recomputed in backward (elementwise, cheap).
    Both directions reuse their [T, I] temporaries in place: on CPU every fresh multi-MB tensor
    costs page faults (measured: ~10% of the step before this). ``dtype`` (autocast's, or None):
    x and the weights are cast to it, as autocast casts a linear's inputs; the casts of the weights
    are not kept (backward casts again), so only the [T, H] and [T, I] activations are saved."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, dtype):
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        x = _cast(x, dtype)
        gate, up = F.linear(x, _cast(w_gate, dtype)), F.linear(x, _cast(w_up, dtype))
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return F.linear(F.silu(gate).mul_(up), _cast(w_down, dtype))

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, *weights = ctx.saved_tensors
        grad_dtypes = [w.dtype for w in weights]
        w_gate, w_up, w_down = (_cast(w, ctx.dtype) for w in weights)
        dy = _cast(dy, ctx.dtype)
        shape = x.shape
        x, gate, up, dy = x.flatten(0, -2), gate.flatten(0, -2), up.flatten(0, -2), dy.flatten(0, -2)
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu(gate)
        tmp = act * up
        grad_down = dy.t() @ tmp
        d_prod = dy @ w_down
        d_up = torch.mul(d_prod, act, out=tmp)
        # silu'(g) = s (1 + g (1 - s)) = s (1 + g - silu(g)), written over act
        d_gate = d_prod.mul_(up).mul_(act.neg_().add_(gate).add_(1).mul_(sig))
        del act, sig
        dx = torch.addmm(d_gate @ w_gate, d_up, w_up)
        grads = (d_gate.t() @ x, d_up.t() @ x, grad_down)
        return (dx.view(shape).to(ctx.x_dtype), *(g.to(dt) for g, dt in zip(grads, grad_dtypes)), None)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) through _SwiGLU, in autocast's dtype under autocast."""
    with autocast_suspended(x.device.type) as dtype:
        return _SwiGLU.apply(x, w_gate, w_up, w_down, dtype)

