"""The optimizer and its learning-rate schedule (the published recipe: AdamW, warmup then cosine)."""

from __future__ import annotations

import math

import torch

from flashdraft.config import OptimConfig


def warmup_cosine(total_steps: int, warmup_frac: float):
    """LR multiplier: linear warmup over warmup_frac of the steps, then cosine to 0."""
    warmup = max(1, round(total_steps * warmup_frac)) if warmup_frac > 0 else 0

    def factor(step: float) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


class RunSchedule:
    """The run's warmup-cosine schedule over ``total`` steps, as a function of the step.

    A run resumed with a budget of another length (another world size or grad_accum: the plan's
    remaining samples take another number of steps; or another train.max_steps) must neither jump
    in LR nor stop short of its end: ``continue_over`` maps the remaining steps linearly onto the
    rest of the schedule. The mapping is a list of segments ``[first step, schedule position,
    positions per step]``; a run that is never resized has one, the identity. A callable object,
    so the LR scheduler's state_dict saves (and a resume restores) it."""

    def __init__(self, total: int, warmup_frac: float):
        self.total, self.warmup_frac = int(total), float(warmup_frac)
        self.segments: list[list[float]] = [[0, 0.0, 1.0]]

    def position(self, step: int) -> float:
        first, position, rate = next(s for s in reversed(self.segments) if s[0] <= step)
        return position + (step - first) * rate

    def end_step(self) -> float:
        """The step at which the current mapping reaches the schedule's end."""
        first, position, rate = self.segments[-1]
        return first + (self.total - position) / rate if rate > 0 else math.inf

    def continue_over(self, step: int, remaining: int) -> bool:
        """From ``step`` on, spread the rest of the schedule over ``remaining`` steps; False when
        the current mapping already ends there (nothing changed)."""
        if remaining <= 0 or math.isclose(self.end_step(), step + remaining):
            return False
        position = self.position(step)
        self.segments = [s for s in self.segments if s[0] < step] + [[step, position, (self.total - position) /
                                                                      remaining]]
        return True

    def __call__(self, step: int) -> float:
        return warmup_cosine(self.total, self.warmup_frac)(self.position(step))


def build_optimizer(params, cfg: OptimConfig, total_steps: int, device: torch.device):
    """AdamW over ``params`` (fused on CUDA) and its per-step LambdaLR schedule (a RunSchedule)."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, RunSchedule(total_steps, cfg.warmup_frac))
    return optimizer, scheduler
