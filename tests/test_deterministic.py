"""train.deterministic on CUDA (issue 28.6): the cuBLAS workspace set before CUDA starts, and no
float cumsum on the training or sampling path (CUDA's cumsum raises under deterministic
algorithms: torch.use_deterministic_algorithms' documented list). CUDA's rule is modelled here by a
dispatch mode that raises on the ops that list names, so the CPU suite holds the code to it; the
GPU check (benchmarks/gpu_checks.sh) runs the real thing twice and compares."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashdraft.objective import SlotLoss, dflash_loss, dpace_weights
from flashdraft.speculative import Sampling, mass_before
from flashdraft.train.runtime import CUBLAS_WORKSPACE, deterministic_mode

aten = torch.ops.aten


class CudaDeterministicRule(TorchDispatchMode):
    """Raises where CUDA would under torch.use_deterministic_algorithms(True): a float / complex
    cumsum, histc, a weighted bincount, put_ (the documented 'will throw' ops a trainer could meet)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        floating = isinstance(args[0], torch.Tensor) and (args[0].is_floating_point() or args[0].is_complex())
        if (packet in (aten.cumsum, aten.cumsum_) and (floating or kwargs.get("dtype") in (torch.float32,
                                                                                          torch.float64))) \
                or packet in (aten.histc, aten.put_, aten.put) \
                or (packet is aten.bincount and (len(args) > 1 and args[1] is not None or kwargs.get("weights")
                                                 is not None)):
            raise RuntimeError(f"{func} does not have a deterministic implementation on CUDA")
        return func(*args, **kwargs)


def _dpace_by_formula(q: list[float], valid: list[bool], alpha: float) -> list[float]:
    """DFLASH2.md 2.1 in fp64: C_k = prod over valid i <= k of (1 - a) q_i + a, w_k = sum over valid m >= k of C_m."""
    c, run = [], 1.0
    for qk, ok in zip(q, valid):
        run *= (1 - alpha) * qk + alpha if ok else 1.0
        c.append(run if ok else 0.0)
    return [sum(c[m] for m in range(k, len(q)) if valid[m]) if valid[k] else 0.0 for k in range(len(q))]


def test_dpace_weights_are_unchanged_by_the_deterministic_form_and_need_no_float_cumsum():
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(64, 15, generator=g, dtype=torch.float64).float() * 4
    valid = (torch.rand(64, 15, generator=g) > 0.2).float()
    for alpha in (0.1, 0.5, 1.0):
        with CudaDeterministicRule():
            w = dpace_weights(ce, valid, alpha)
        q = torch.exp(-ce.double())
        by_formula = torch.tensor([_dpace_by_formula(q[r].tolist(), (valid[r] > 0).tolist(), alpha)
                                   for r in range(64)], dtype=torch.float64)
        torch.testing.assert_close(w.double(), by_formula, rtol=1e-6, atol=1e-7)
        # the float cumsum form it replaces, to its own rounding
        qt = torch.where(valid > 0, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        c = qt.cumprod(-1) * valid
        torch.testing.assert_close(w, c.flip(-1).cumsum(-1).flip(-1) * valid, rtol=1e-6, atol=1e-7)


def test_a_dpace_loss_runs_under_the_cuda_rule():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 7, 16, generator=g, requires_grad=True)
    head, labels = torch.randn(50, 16, generator=g), torch.randint(0, 50, (2, 3, 8), generator=g)
    valid = (torch.rand(2, 3, 8, generator=g) > 0.2).float()
    valid[:, :, 0] = 0
    with CudaDeterministicRule():
        out = dflash_loss(hidden, head, labels, valid, chunk_size=5, slot_loss=SlotLoss(dpace_alpha=0.5))
        out.loss.backward()
    assert torch.isfinite(hidden.grad).all()


def test_top_p_is_unchanged_by_the_deterministic_prefix_mass():
    """The kept set: the smallest set of most likely tokens whose mass reaches top_p, as the fp64
    definition says and as the float cumsum gave; the prefix mass itself within 1e-12 of fp64."""
    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        logits = torch.randn(4, 1000, generator=g) * (0.5 + trial / 4)
        sampling = Sampling(temperature=0.8, top_p=(0.5, 0.9, 0.95, 0.99)[trial % 4])
        with CudaDeterministicRule():
            got = sampling.target_probs(logits)
        probs, order = (logits.double() / 0.8).softmax(-1).sort(-1, descending=True)
        before = probs.cumsum(-1) - probs
        torch.testing.assert_close(mass_before(probs.float()), before, rtol=0, atol=1e-6)
        drop = (before >= sampling.top_p).scatter(-1, order, before >= sampling.top_p)
        expected = (logits.double() / 0.8).masked_fill(drop, float("-inf")).softmax(-1).float()
        assert torch.equal(got > 0, expected > 0)
        torch.testing.assert_close(got, expected)
        p32 = (logits / 0.8).softmax(-1).sort(-1, descending=True).values
        assert torch.equal(mass_before(p32) >= sampling.top_p, p32.cumsum(-1) - p32 >= sampling.top_p)
    exact = torch.tensor([0.5, 0.25, 0.125, 0.125])  # dyadic: fixed point is exact
    assert mass_before(exact).tolist() == [0.0, 0.5, 0.75, 0.875]


def test_deterministic_mode_sets_the_cublas_workspace_and_keeps_a_given_one(monkeypatch):
    was = torch.are_deterministic_algorithms_enabled()
    try:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        deterministic_mode()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        deterministic_mode()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_rule_model_raises_where_cuda_would():
    with CudaDeterministicRule(), pytest.raises(RuntimeError, match="deterministic"):
        torch.rand(5).cumsum(0)
    with CudaDeterministicRule():
        torch.arange(5).cumsum(0)  # integer scans are deterministic
