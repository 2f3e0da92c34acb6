"""The lean custom-backward RMSNorm / RoPE / SwiGLU under bf16 autocast with fp32 master weights
(how the trainer runs on CUDA): values and gradients as transformers' stock modules under the same
autocast, both measured against fp64, and saved activations no larger than the bf16-weights path's."""

import copy

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from flashdraft.bench.step import Heads
from flashdraft.config import ObjectiveConfig
from flashdraft.drafter import DFlashDrafter
from flashdraft.drafter.kernels import RMSNorm, apply_rope, swiglu
from flashdraft.drafter.serving import DFlash2Modules
from flashdraft.objective import Blocks, SelectorLoss, block_input_ids, block_labels_and_weights, sample_anchors
from flashdraft.toy import causal_lm_config
from flashdraft.train.backend import Backend
from flashdraft.train.step import forward_backward
from flashdraft.train.strategy import strategy_for

BF16 = torch.bfloat16


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error ||got - want|| / ||want||, in fp64."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def run(fn, inputs, dy, autocast: bool):
    """fn(*inputs) and the gradients of sum(out * dy) with respect to ``inputs``."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = fn(*inputs)
    grads = torch.autograd.grad((out.double() * dy).sum(), inputs)
    return out, grads


def kernel_case(kernel: str, g: torch.Generator):
    """(lean fn, stock fn, inputs: a bf16 activation then fp32 weights / tables) for one kernel."""
    if kernel == "rmsnorm":
        norm = RMSNorm(64, eps=1e-6)

        def call(lean):
            def fn(x, w):
                norm.lean = lean
                return torch.func.functional_call(norm, {"weight": w}, (x,))
            return fn
        return call(True), call(False), [torch.randn(3, 7, 64, generator=g).to(BF16) * 3,
                                         1 + 0.3 * torch.randn(64, generator=g)]
    if kernel == "rope":
        angles = torch.rand(2, 7, 8, generator=g) * 6
        cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)  # fp32, as RotaryEmbedding's
        return (lambda x: apply_rope(x, cos, sin, True), lambda x: apply_rope(x, cos, sin, False),
                [torch.randn(2, 4, 7, 16, generator=g).to(BF16)])
    mlp = Qwen3MLP(causal_lm_config(300, "qwen3", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                                    intermediate=192))
    weights = [0.1 * torch.randn(p.shape, generator=g) for p in (mlp.gate_proj.weight, mlp.up_proj.weight,
                                                                  mlp.down_proj.weight)]

    def stock(x, wg, wu, wd):
        return torch.func.functional_call(mlp, {"gate_proj.weight": wg, "up_proj.weight": wu,
                                                "down_proj.weight": wd}, (x,))
    return swiglu, stock, [torch.randn(2, 7, 64, generator=g).to(BF16)] + weights


@pytest.mark.parametrize("kernel", ["rmsnorm", "rope", "swiglu"])
def test_lean_kernel_under_bf16_autocast_is_as_accurate_as_the_stock_module(kernel):
    g = torch.Generator().manual_seed(0)
    lean, stock, inputs = kernel_case(kernel, g)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        probe = lean(*inputs)
    dy = torch.randn(probe.shape, generator=g, dtype=torch.float64)
    exact, exact_grads = run(stock, [t.double() for t in inputs], dy, autocast=False)
    got, got_grads = run(lean, inputs, dy, autocast=True)
    ref, ref_grads = run(stock, inputs, dy, autocast=True)
    assert got.dtype == BF16  # output (and what is saved) in autocast's dtype, never fp32 [rows, H]
    assert rel(got, ref) < 1e-2
    assert rel(got, exact) < max(2 * rel(ref, exact), 8e-3)
    for i, (mine, theirs, want) in enumerate(zip(got_grads, ref_grads, exact_grads)):
        assert mine.dtype == inputs[i].dtype  # fp32 weights get fp32 gradients
        assert rel(mine, theirs) < 2e-2, f"input {i}"
        assert rel(mine, want) < max(2 * rel(theirs, want), 1e-2), f"input {i}: {rel(mine, want):.2e} vs fp64"


def drafter_step(dflash2: bool):
    """A small drafter (fp32 master weights), bf16 features / embeddings / head, and one micro-batch."""
    g = torch.Generator().manual_seed(1)
    vocab, hidden, seq, bs = 300, 64, 40, 4
    target_cfg = causal_lm_config(vocab, "qwen3", num_layers=3, hidden=hidden, num_heads=4, num_kv_heads=2,
                                  max_position_embeddings=512)
    from flashdraft.drafter.serving import drafter_config_from_target
    cfg = drafter_config_from_target(target_cfg, num_layers=2, block_size=bs, mask_token_id=vocab - 1,
                                     target_layer_ids=[0, 2],
                                     dflash2=DFlash2Modules(2, 8, 8, 5) if dflash2 else None)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.2, generator=g)
    heads = Heads(0.5 * torch.randn(vocab, hidden, generator=g), 0.2 * torch.randn(vocab, hidden, generator=g))
    ids = torch.randint(0, vocab - 1, (2, seq), generator=g)
    lengths = torch.tensor([seq, seq - 9])
    loss_mask = (torch.arange(seq) < lengths[:, None]).long()
    anchors, valid = sample_anchors(loss_mask, lengths, 8, seed=3)
    labels, weights = block_labels_and_weights(ids, loss_mask, lengths, anchors, valid, bs, 3.0)
    blocks = Blocks(anchors, valid, block_input_ids(ids, anchors, bs, vocab - 1), labels, weights,
                    selector=SelectorLoss(1.0) if dflash2 else None)
    features = torch.randn(2, seq, 2 * hidden, generator=g)
    return drafter, heads, features, blocks


def micro_step(drafter, heads, features, blocks, *, autocast: bool):
    """The trainer's micro-step (``forward_backward``, LM head chunks of 16 slots, one process)."""
    strategy = strategy_for(drafter, heads, ObjectiveConfig(loss_chunk_size=16))
    return forward_backward(strategy, Backend(drafter), features, blocks,
                            autocast=torch.autocast("cpu", dtype=BF16, enabled=autocast))


def step_grads(drafter, heads, features, blocks, *, lean: bool, precision: str):
    """The trainer's micro-step: "trainer" (fp32 weights, bf16 autocast, bf16 features and head),
    "bf16" (everything bf16, no autocast) or "fp64" (no autocast); (loss, gradients in fp64)."""
    dtype = {"trainer": BF16, "bf16": BF16, "fp64": torch.float64}[precision]
    drafter = copy.deepcopy(drafter).to(torch.float32 if precision == "trainer" else dtype)
    heads = copy.deepcopy(heads).to(dtype)
    drafter.set_lean(lean)
    outs = micro_step(drafter, heads, features.to(dtype), blocks, autocast=precision == "trainer")
    loss = sum(float(o.loss) for o in outs)
    return loss, {n: p.grad.double() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_trainer_step_gradients_with_lean_kernels_under_autocast(dflash2):
    """The lean kernels in the whole step under autocast: gradients as close to fp64 as the stock
    modules' under the same autocast (per parameter, within bf16's error)."""
    drafter, heads, features, blocks = drafter_step(dflash2)
    exact_loss, exact = step_grads(drafter, heads, features, blocks, lean=False, precision="fp64")
    loss, got = step_grads(drafter, heads, features, blocks, lean=True, precision="trainer")
    ref_loss, ref = step_grads(drafter, heads, features, blocks, lean=False, precision="trainer")
    assert abs(loss - exact_loss) < 2e-2 * abs(exact_loss) and abs(ref_loss - exact_loss) < 2e-2 * abs(exact_loss)
    assert got.keys() == exact.keys() == ref.keys()
    for name, want in exact.items():
        assert rel(got[name], want) < max(2 * rel(ref[name], want), 3e-2), (
            f"{name}: lean {rel(got[name], want):.2e} vs stock {rel(ref[name], want):.2e} against fp64")


def saved_activation_bytes(drafter, heads, features, blocks, precision: str) -> int:
    """Bytes of the tensors one micro-step saves for backward, weights and their casts apart
    (each storage once)."""
    dtype = torch.float32 if precision == "trainer" else BF16
    drafter, heads = copy.deepcopy(drafter).to(dtype), copy.deepcopy(heads).to(BF16)
    weight_shapes = {tuple(p.shape) for p in list(drafter.parameters()) + list(heads.parameters())}
    seen = {}

    def pack(t):
        if tuple(t.shape) not in weight_shapes:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        micro_step(drafter, heads, features.to(BF16), blocks, autocast=precision == "trainer")
    return sum(seen.values())


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_trainer_path_saves_no_more_than_the_bf16_path(dflash2):
    # Before the lean kernels ran under autocast, the stock RMSNorm's fp32 weight promoted its
    # outputs to fp32 [rows, H] and autograd's graphs kept fp32 copies: ~1.8x the bf16 path.
    drafter, heads, features, blocks = drafter_step(dflash2)
    trainer = saved_activation_bytes(drafter, heads, features, blocks, "trainer")
    bf16 = saved_activation_bytes(drafter, heads, features, blocks, "bf16")
    assert trainer <= 1.05 * bf16, f"trainer path saves {trainer} bytes, the bf16 path {bf16}"
