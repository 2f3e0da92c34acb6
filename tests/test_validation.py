"""The Validator's eval drafter: built on the eval device in the eval dtype, no second init."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import overrides
from flashdraft.config import load_config
from flashdraft.train.trainer import Trainer


class _Ops(TorchDispatchMode):
    """Every op that writes real (non-meta) memory, with its output's device."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.ops.append((func.__name__, out.device.type))
        return out


def test_the_eval_drafter_is_built_on_meta_and_takes_the_rounded_training_weights(tiny_job, tmp_path):
    """No random initialisation of a second drafter touches memory (the build used to make an
    fp32 drafter on the CPU, initialise it, then load and move it: seconds and GBs per eval at
    8B sizes); the weights are the training ones rounded to bf16, in the target's dtype, on the
    eval device, and the RoPE tables the training drafter's (fp32). On CPU the eval device is
    the host, so "no host copy" shows here as: nothing but the rounded weights is allocated."""
    trainer = Trainer(load_config(overrides=overrides(tiny_job, tmp_path / "run",
                                                      eval__prompts_path=tiny_job / "prompts.jsonl")))
    validator, drafter = trainer.validator, trainer.drafter
    with _Ops() as seen:
        shipped = validator.shipped_drafter()
    inits = [op for op, _ in seen.ops if op.split(".")[0] in ("uniform_", "normal_", "fill_", "zero_", "randn")]
    assert inits == [], inits
    weights = dict(drafter.state_dict())
    for name, value in shipped.state_dict().items():
        assert value.device == trainer.device and value.dtype == trainer.target.dtype, name
        assert torch.equal(value, weights[name].to(torch.bfloat16).to(value.dtype)), name
    buffers = dict(drafter.named_buffers())
    for name, buf in shipped.named_buffers():
        if name not in weights:
            assert buf.dtype == torch.float32 and torch.equal(buf, buffers[name]), name
    assert not any(p.is_meta for p in shipped.parameters()) and not shipped.training
    allocated = {op for op, _ in seen.ops}
    assert allocated <= {"_to_copy.default", "detach.default", "alias.default"}, allocated
