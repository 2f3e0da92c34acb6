"""`flashdraft bench pipeline`: does the pipeline overlap its stages? Measured, same run.

Two parts, each run sequentially (``pipeline.enabled=false``: the same stages inline) and
pipelined, back to back in one process:

1. synthetic: three stages (data, target, drafter) of chosen costs (a, b, c) ms that do real
   work for that long (``--work spin``: small torch matmuls, which release the GIL, until the
   stage's time is up; ``--work sleep``: a stage that holds no CPU, like a thread waiting on a
   GPU or on disk). Ideal pipelined rate = 1 / max(a, b, c), sequential = 1 / (a + b + c);
   ``efficiency`` = pipelined / ideal.
2. real: the actual Trainer with a tiny Qwen3-shaped target and a DFlash drafter on CPU,
   sequential vs pipelined steps/s at the chosen intra-op thread counts, with the per-stage
   busy / starved / blocked split and the bound.

It also prints the storage a full feature cache would need (``--config`` or ``--target`` /
``--data`` give the user's own model and dataset; otherwise the tiny job's), and whether the
configured ``pipeline.feature_cache_bytes`` + ``feature_cache_disk_bytes`` cover it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.bench.jobs import real_run, tiny_job, tiny_job_taps
from flashdraft.feed.cache import full_cache_bytes
from flashdraft.feed.flow import Pipeline, Stage
from flashdraft.metrics import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--costs", default="10,30,20", help="synthetic stage costs a,b,c in ms (data,target,drafter)")
    parser.add_argument("--work", default="spin,sleep", help="synthetic work kinds to run: spin, sleep (comma list)")
    parser.add_argument("--items", type=int, default=60, help="items per synthetic run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; medians are reported")
    parser.add_argument("--capacity", type=int, default=2, help="channel capacity")
    parser.add_argument("--real-steps", type=int, default=30, help="trainer steps per real run (0: skip the real part)")
    parser.add_argument("--threads", default="1,2", help="torch intra-op thread counts for the real part")
    parser.add_argument("--target-layers", type=int, default=8,
                        help="real part: the tiny target's depth (8: target-bound, ~2x the drafter step; 4: balanced)")
    parser.add_argument("--config", default="",
                        help="a flashdraft train config: its target, data, taps and feature-cache budgets, for the "
                        "feature-cache size estimate (the options below override it)")
    parser.add_argument("--target", default="", help="a HF target dir, for the feature-cache size estimate")
    parser.add_argument("--data", default="", help="training data, for the feature-cache size estimate")
    parser.add_argument("--num-taps", type=int, default=None,
                        help="tapped layers, for the feature-cache size estimate (5)")
    parser.add_argument("--feature-cache-bytes", type=float, default=None,
                        help="RAM budget to compare with the estimate")
    parser.add_argument("--feature-cache-disk-bytes", type=float, default=None,
                        help="disk budget to compare with the estimate")
    parser.add_argument("--estimate-only", action="store_true",
                        help="only the feature-cache size estimate (skip the runs)")
    parser.add_argument("--json", default="", help="also write the results as JSON to this file")


# ---- synthetic stages ----------------------------------------------------------------------


def _work(kind: str, ms: float, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Occupy the calling thread for ``ms``: real tensor work (GIL released inside each op) or a sleep."""
    end = time.perf_counter() + ms / 1e3
    if kind == "sleep":
        time.sleep(ms / 1e3)
        return
    a, b = scratch
    while time.perf_counter() < end:
        torch.mm(a, b)


def synthetic(costs: tuple[float, float, float], kind: str, items: int, capacity: int, threaded: bool) -> dict:
    """One run: items/s over the steady state (the first item's latency excluded)."""
    scratch = [(torch.randn(96, 96), torch.randn(96, 96)) for _ in range(3)]  # one per stage: no sharing
    a, b, c = costs

    def source():
        for i in range(items):
            _work(kind, a, scratch[0])
            yield i

    def target(x):
        _work(kind, b, scratch[1])
        return x

    stamps = []
    with Pipeline(source(), [Stage("target", target)], capacity=capacity, threaded=threaded) as pipe:
        for _ in pipe:
            _work(kind, c, scratch[2])
            stamps.append(time.perf_counter())
    report = pipe.report(window=False)
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return {"items_per_s": rate, "bound": report.bound, "report": report}


def run_synthetic(args) -> list[dict]:
    costs = tuple(float(x) for x in args.costs.split(","))
    if len(costs) != 3:
        raise SystemExit("--costs needs three values a,b,c (ms)")
    rows = []
    torch.set_num_threads(1)  # each synthetic stage is one thread of work
    for kind in [k.strip() for k in args.work.split(",") if k.strip()]:
        seq = [synthetic(costs, kind, args.items, args.capacity, False) for _ in range(args.repeats)]
        pipe = [synthetic(costs, kind, args.items, args.capacity, True) for _ in range(args.repeats)]
        row = {
            "work": kind, "costs_ms": costs,
            "sequential_per_s": statistics.median(r["items_per_s"] for r in seq),
            "pipelined_per_s": statistics.median(r["items_per_s"] for r in pipe),
            "ideal_sequential_per_s": 1e3 / sum(costs), "ideal_per_s": 1e3 / max(costs),
            "bound": pipe[-1]["bound"], "pipelined_runs": [round(r["items_per_s"], 2) for r in pipe],
        }
        row["efficiency"] = row["pipelined_per_s"] / row["ideal_per_s"]
        rows.append(row)
        print(f"\nsynthetic stages, work={kind}, costs (data, target, drafter) = {costs} ms, {args.items} items, "
              f"median of {args.repeats}")
        print(f"  sequential  {row['sequential_per_s']:7.2f} items/s   "
              f"(1/(a+b+c) = {row['ideal_sequential_per_s']:.2f})")
        print(f"  pipelined   {row['pipelined_per_s']:7.2f} items/s   (runs: {row['pipelined_runs']})")
        print(f"  bound       {row['bound']}, ideal 1/max(a,b,c) = {row['ideal_per_s']:.2f} items/s")
        print(f"  efficiency  {row['efficiency']:.3f}   (pipelined / ideal; acceptance >= 0.90)")
        print("  last pipelined run's stage split (per item):")
        print("    " + pipe[-1]["report"].format().replace("\n", "\n    "))
    return rows


# ---- the real trainer on CPU ---------------------------------------------------------------


def run_real(args) -> list[dict]:
    rows = []
    logging.getLogger("flashdraft").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        layers = args.target_layers
        taps = tiny_job_taps(layers)
        job = tiny_job(Path(tmp), layers=layers)
        print(f"\nreal trainer on CPU: tiny Qwen3 target ({layers} layers, hidden 256, taps {taps}), 1-layer drafter, "
              f"8 x 256 tokens per step, {args.real_steps} steps, median of {args.repeats} (sequential and "
              "pipelined runs alternate)")
        for threads in [int(t) for t in args.threads.split(",")]:
            results = {False: [], True: []}
            for r in range(args.repeats):  # ABBA order, so that drift in the machine's load hits both alike
                for enabled in ((False, True) if r % 2 == 0 else (True, False)):
                    results[enabled].append(real_run(job, Path(tmp) / f"run{enabled}{threads}{r}",
                                                     steps=args.real_steps, enabled=enabled, threads=threads,
                                                     capacity=args.capacity))
            row = {"threads": threads,
                   "sequential_steps_per_s": statistics.median(r["steps_per_s"] for r in results[False]),
                   "pipelined_steps_per_s": statistics.median(r["steps_per_s"] for r in results[True]),
                   "sequential_runs": [round(r["steps_per_s"], 3) for r in results[False]],
                   "pipelined_runs": [round(r["steps_per_s"], 3) for r in results[True]],
                   "pair_speedups": [round(p["steps_per_s"] / q["steps_per_s"], 3)
                                     for q, p in zip(results[False], results[True])]}
            seq_report, pipe_report = results[False][-1]["report"], results[True][-1]["report"]
            row["bound"] = pipe_report.bound
            row["ideal_steps_per_s"] = seq_report.ideal_items_per_s  # 1 / slowest stage, measured without overlap
            row["speedup"] = row["pipelined_steps_per_s"] / row["sequential_steps_per_s"]
            row["efficiency"] = row["pipelined_steps_per_s"] / row["ideal_steps_per_s"]
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in results[True])
            rows.append(row)
            print(f"\n  torch threads {threads}: sequential {row['sequential_steps_per_s']:.3f} steps/s "
                  f"{row['sequential_runs']}, pipelined {row['pipelined_steps_per_s']:.3f} steps/s "
                  f"{row['pipelined_runs']}, speedup {row['speedup']:.2f}x (each pair: {row['pair_speedups']})")
            print(f"  ideal (1/slowest stage, from the sequential split) {row['ideal_steps_per_s']:.3f} steps/s, "
                  f"{row['bound']}, efficiency {row['efficiency']:.2f}")
            print("  sequential stage split (last run):")
            print("    " + seq_report.format().replace("\n", "\n    "))
            print("  pipelined stage split (last run):")
            print("    " + pipe_report.format().replace("\n", "\n    "))
        cache = feature_cache_estimate(str(job / "target"), str(job / "data"), 4)
        print(f"\n  full feature cache for the tiny job: {cache['human']} "
              f"({cache['tokens']} tokens x {cache['per_token']} B)")
    return rows


# ---- feature cache size --------------------------------------------------------------------


def feature_cache_estimate(target: str, data: str, num_taps: int, dtype_bytes: int = 2) -> dict:
    """Bytes a full cache of packed target features [tokens, K*H] would need (bf16 by default)."""
    from transformers import AutoConfig

    from flashdraft.data.dataset import open_dataset

    hidden = int(AutoConfig.from_pretrained(target).hidden_size)
    tokens = int(open_dataset(data, progress=False).lengths.sum())
    total = full_cache_bytes(tokens, num_taps * hidden, dtype_bytes)
    return {"tokens": tokens, "per_token": num_taps * hidden * dtype_bytes, "bytes": total,
            "human": format_bytes(total)}


def cache_budget_verdict(need: int, ram_bytes: float, disk_bytes: float) -> str:
    """Whether a RAM + disk budget (per process) holds a full cache of ``need`` bytes."""
    budget = ram_bytes + disk_bytes
    held = f"RAM {format_bytes(ram_bytes)} + disk {format_bytes(disk_bytes)}"
    if budget <= 0:
        return (f"the feature cache is off ({held}); set pipeline.feature_cache_bytes (RAM) and/or "
                "feature_cache_disk_bytes")
    if budget >= need:
        return f"the budget ({held}) covers it: from epoch 2 on, every target forward is a cache read (one process)"
    return (f"the budget ({held}) holds {100 * budget / need:.0f}% of it: later epochs hit about that share of "
            f"samples (one process); raise it to {format_bytes(need)} for a full cache")


def _feature_cache_args(args) -> tuple[str, str, int, float, float]:
    """(target, data, taps, RAM budget, disk budget) from --config and the explicit options."""
    target, data, taps, ram, disk = "", "", 5, 0.0, 0.0
    if args.config:
        from flashdraft.config import load_config

        cfg = load_config(args.config)
        target, data = cfg.target.path, cfg.data.path
        taps = len(cfg.target.layer_ids) if cfg.target.layer_ids else cfg.target.num_taps
        ram, disk = cfg.pipeline.feature_cache_bytes, cfg.pipeline.feature_cache_disk_bytes
    pick = lambda given, default: default if given is None or given == "" else given  # noqa: E731
    return (pick(args.target, target), pick(args.data, data), pick(args.num_taps, taps),
            pick(args.feature_cache_bytes, ram), pick(args.feature_cache_disk_bytes, disk))


def run(args) -> int:
    torch.manual_seed(0)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
    results = {}
    if not args.estimate_only:
        results["synthetic"] = run_synthetic(args)
        if args.real_steps:
            results["real"] = run_real(args)
    target, data, taps, ram, disk = _feature_cache_args(args)
    if target and data:
        est = feature_cache_estimate(target, data, taps)
        est["verdict"] = cache_budget_verdict(est["bytes"], ram, disk)
        results["feature_cache"] = est
        print(f"\nfull feature cache for {data} with {target} ({taps} taps, bf16): {est['human']} "
              f"({est['tokens']} tokens x {est['per_token']} B); {est['verdict']}")
    if args.json:
        from flashdraft.outputs import write_report

        write_report(args.json, json.dumps(results, indent=1, default=str), flag="--json")
    return 0
