"""The optimizer and its learning-rate schedule (the published recipe: AdamW, warmup then cosine)."""

from __future__ import annotations

import math
from typing import NamedTuple

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

    def ended(self, step: int) -> bool:
        """Whether the schedule is over at ``step``: its learning rate is 0 from there on."""
        return self.position(step) >= self.total

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


class SchedulePosition(NamedTuple):
    """Where an optimizer step sits on the run's schedule: the schedule's ``step`` it counts as
    (0-based; fractional once a resumed run's steps were spread over the rest of the schedule,
    RunSchedule.continue_over) of its ``total`` steps. What step-dependent weights (DFlash2's
    selector term) are read at, so that they follow the LR schedule through a resize."""

    step: float
    total: int

    @property
    def fraction(self) -> float:
        return self.step / self.total


class RunScheduler(torch.optim.lr_scheduler.LambdaLR):
    """The optimizer's per-step LR scheduler over the run's ``RunSchedule``, with the questions
    its owner asks of the schedule: a step's position on it, and a resized resume's remapping.
    Its state_dict is LambdaLR's (the schedule's segments included)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float):
        super().__init__(optimizer, RunSchedule(total_steps, warmup_frac))

    @property
    def schedule(self) -> RunSchedule:
        return self.lr_lambdas[0]  # LambdaLR keeps it (and restores it in place on load_state_dict)

    def position(self, step: int) -> SchedulePosition:
        """Where optimizer step ``step`` (0-based) sits on the schedule."""
        return SchedulePosition(self.schedule.position(step), self.schedule.total)

    def continue_over(self, step: int, remaining: int) -> bool:
        """RunSchedule.continue_over: the rest of the schedule spread over ``remaining`` steps."""
        return self.schedule.continue_over(step, remaining)

    def ended(self, step: int) -> bool:
        """RunSchedule.ended: the learning rate is 0 from optimizer step ``step`` on."""
        return self.schedule.ended(step)


def build_optimizer(params, cfg: OptimConfig, total_steps: int, device: torch.device):
    """AdamW over ``params`` (fused on CUDA) and its per-step LR scheduler (a RunScheduler)."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda")
    return optimizer, RunScheduler(optimizer, total_steps, cfg.warmup_frac)
