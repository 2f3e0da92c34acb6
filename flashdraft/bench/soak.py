"""`flashdraft bench soak`: thousands of tiny CPU training steps with periodic checkpoints and
evals, recording process RSS, open file descriptors and thread count over time
(docs/reliability.md has figures).

    OMP_NUM_THREADS=1 flashdraft bench soak --steps 3000 --out /tmp/soak

A leak shows as RSS, fds or threads growing with the step count after warm-up; it prints the
samples and a summary and writes them to OUT/soak.json. Exit 1 if fds or threads grew, or RSS
grew by more than --max-rss-growth-mb after warm-up.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from flashdraft.bench.jobs import soak_job
from flashdraft.config import load_config
from flashdraft.outputs import write_report
from flashdraft.train.trainer import Trainer


def sample(step: int, t0: float) -> dict:
    proc = psutil.Process()
    return {"step": step, "elapsed_s": round(time.monotonic() - t0, 1),
            "rss_mb": round(proc.memory_info().rss / 2**20, 1), "fds": proc.num_fds(),
            "threads": threading.active_count(), "os_threads": proc.num_threads()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=100, help="sample the process every this many steps")
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=500, help="steps before the RSS baseline is taken")
    parser.add_argument("--max-rss-growth-mb", type=float, default=25.0)
    parser.add_argument("--out", default="runs/soak")


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "run").exists():  # the soak's own scratch run: every soak starts from step 0
        print(f"removing the previous soak run in {out / 'run'}", file=sys.stderr)
        shutil.rmtree(out / "run")
    soak_job(out)
    torch.set_num_threads(1)
    config = load_config(overrides=[
        f"target.path={out / 'target'}", "drafter.mask_token_id=299", "drafter.num_layers=1", "drafter.block_size=4",
        "target.layer_ids=[1,2]", f"data.path={out / 'data'}", f"eval.data_path={out / 'heldout'}",
        f"eval.prompts_path={out / 'prompts.jsonl'}", "data.token_budget=160", "data.max_batch_size=4",
        "objective.num_anchors=8", f"train.max_steps={args.steps}", "train.log_every=50",
        f"checkpoint.save_every={args.save_every}", f"eval.every={args.eval_every}", "eval.num_prompts=4",
        "eval.max_new_tokens=16", "checkpoint.keep_last=2", f"train.output_dir={out / 'run'}", "train.device=cpu",
        "checkpoint.resume=never",
    ])
    samples: list[dict] = []
    t0 = time.monotonic()

    def after_step(trainer) -> None:
        if trainer.step % args.every == 0 or trainer.step == 1:
            samples.append(sample(trainer.step, t0))
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)

    with Trainer(config) as trainer:
        trainer.fit(on_step=after_step)
    samples.append(sample(trainer.step, t0))
    base = next(s for s in samples if s["step"] >= min(args.warmup, trainer.step))
    last = samples[-1]
    after = [s for s in samples if s["step"] >= base["step"]]
    summary = {
        "steps": trainer.step, "wall_s": last["elapsed_s"], "checkpoints_every": args.save_every,
        "evals_every": args.eval_every, "baseline_step": base["step"],
        "rss_mb_first": samples[0]["rss_mb"], "rss_mb_baseline": base["rss_mb"], "rss_mb_last": last["rss_mb"],
        "rss_mb_max_after_baseline": max(s["rss_mb"] for s in after),
        "rss_growth_mb_after_baseline": round(last["rss_mb"] - base["rss_mb"], 1),
        "fds_baseline": base["fds"], "fds_last": last["fds"], "fds_max": max(s["fds"] for s in after),
        "threads_baseline": base["threads"], "threads_last": last["threads"],
        "os_threads_baseline": base["os_threads"], "os_threads_last": last["os_threads"],
        "checkpoints_on_disk": sorted(p.name for p in (out / "run" / "checkpoints").iterdir()),
    }
    write_report(out / "soak.json", json.dumps({"summary": summary, "samples": samples}, indent=1), flag="--out")
    print(json.dumps(summary, indent=1))
    leaked = (last["fds"] > base["fds"] or last["threads"] > base["threads"] or last["os_threads"] > base["os_threads"]
              or summary["rss_growth_mb_after_baseline"] > args.max_rss_growth_mb)
    return 1 if leaked else 0
