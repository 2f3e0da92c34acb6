"""Measure the peak memory of real CPU training steps of the drafter, for tests/test_plan.py.

Run as a fresh process: ``python tests/plan_measure.py JSON`` with JSON a list of
[target_dir, S, [overrides...]] prints one JSON list of {"peak": bytes, "batch": B}. Each
measure is the process's own peak resident set (VmHWM, reset through /proc/self/clear_refs)
over building the drafter and its optimizer and
running two real optimizer steps (forward_backward, clipping, AdamW), minus the resident set
before them. glibc's mmap threshold is fixed at 64 KiB first, so every tensor is its own
mapping, paged in when written and returned when freed: the resident set follows the live
tensors, not a heap that keeps what it once held.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import types


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(libc, target: str, seq_len: int, overrides: list[str]) -> dict:
    import torch

    from flashdraft.config import load_config
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.objective import default_gamma, make_blocks
    from flashdraft.train.backend import Backend
    from flashdraft.train.optim import build_optimizer
    from flashdraft.train.plan import (
        _drafter_config,
        _target_shape,
        anchors_per_pass,
        batch_size_at,
        target_config_path,
    )
    from flashdraft.train.step import forward_backward
    from flashdraft.train.strategy import strategy_for

    cfg = load_config(None, [f"target.path={target}", "train.device=cpu", *overrides])
    shape = _target_shape(str(target_config_path(target)), False)
    b = batch_size_at(cfg, seq_len)
    config = _drafter_config(cfg, shape)
    gen = torch.Generator().manual_seed(0)
    heads = types.SimpleNamespace(embed=torch.nn.Embedding(shape.vocab, shape.hidden).requires_grad_(False),
                                  lm_head=torch.nn.Linear(shape.hidden, shape.vocab, bias=False).requires_grad_(False))
    k = len(config["dflash_config"]["target_layer_ids"])
    features = torch.randn(b, seq_len, k * shape.hidden, generator=gen)
    input_ids = torch.randint(0, shape.vocab - 1, (b, seq_len), generator=gen)
    loss_mask = torch.ones(b, seq_len, dtype=torch.long)
    lengths = torch.full((b,), seq_len)
    blocks = [make_blocks(input_ids, loss_mask, lengths, block_size=cfg.drafter.block_size,
                          mask_token_id=config["dflash_config"]["mask_token_id"],
                          num_anchors=cfg.objective.num_anchors, gamma=default_gamma(cfg.drafter.block_size),
                          seed=step).shard(0, cfg.target.tensor_parallel) for step in range(2)]
    assert blocks[0].anchors.shape[1] == anchors_per_pass(cfg, seq_len)  # the plan's shapes
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = _rss("VmRSS")
    drafter = DFlashDrafter(config, attention=cfg.drafter.attention)
    drafter.reset_parameters(0.02, gen)
    optimizer, _ = build_optimizer(drafter.parameters(), cfg.optim, 10, torch.device("cpu"))
    strategy, backend = strategy_for(drafter, heads, cfg.objective), Backend(drafter)
    for blk in blocks:
        forward_backward(strategy, backend, features, blk)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = _rss("VmHWM") - base
    del drafter, optimizer, blocks, features
    return {"peak": peak, "batch": b}


def main(runs: list) -> list[dict]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed (no dynamic raise)
    import torch

    torch.set_num_threads(1)
    return [measure(libc, target, int(seq_len), overrides) for target, seq_len, overrides in runs]


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
