"""`flashdraft bench train`: the real trainer on a fixed tiny config, for comparing changes.

A random Qwen3-shaped target (8 layers, hidden 256), a 1-layer drafter, 8 x 256 tokens per
step on CPU (random tokens: this measures speed, not quality). Prints steps/s, tokens/s and
where the step time goes, per stage. Run it before and after a change to a hot path.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from flashdraft.bench.jobs import real_run, tiny_job


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="trainer steps (the first few are warm-up)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--sequential", action="store_true", help="pipeline.enabled=false (stages run inline)")
    parser.add_argument("--glibc-default", action="store_true",
                        help="train.keep_freed_host_memory=false: glibc's default malloc (freed blocks unmapped)")
    parser.add_argument("--feature-cache-bytes", type=float, default=0,
                        help="pipeline.feature_cache_bytes (RAM); a full cache of the tiny job takes 64M (fp32)")


def run(args) -> int:
    logging.getLogger("flashdraft").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        job = tiny_job(Path(tmp))
        result = real_run(job, Path(tmp) / "run", steps=args.steps, enabled=not args.sequential,
                          threads=args.threads, capacity=2, feature_cache_bytes=int(args.feature_cache_bytes),
                          keep_freed_host_memory=not args.glibc_default)
    mode = "sequential" if args.sequential else "pipelined"
    print(f"bench train ({mode}, {args.threads} threads, {args.steps} steps): {result['steps_per_s']:.3f} steps/s, "
          f"{result['tokens_per_s']:.0f} target tokens/s")
    rates = ", ".join(f"{r:.3f}" for r in result["epoch_steps_per_s"])
    print(f"steps/s per epoch ({result['steps_per_epoch']} steps each, the first step of each excluded): {rates}")
    print(result["report"].format())
    return 0
