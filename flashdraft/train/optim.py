"""The optimizer and its learning-rate schedule (the published recipe: AdamW, warmup then cosine)."""

from __future__ import annotations

import math

import torch

from flashdraft.config import OptimConfig


def warmup_cosine(total_steps: int, warmup_frac: float):
    """LR multiplier: linear warmup over warmup_frac of the steps, then cosine to 0."""
    warmup = max(1, round(total_steps * warmup_frac)) if warmup_frac > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_optimizer(params, cfg: OptimConfig, total_steps: int, device: torch.device):
    """AdamW over ``params`` (fused on CUDA) and its per-step LambdaLR schedule."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total_steps, cfg.warmup_frac))
    return optimizer, scheduler
