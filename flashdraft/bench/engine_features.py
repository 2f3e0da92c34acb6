"""`flashdraft bench engine-features`: the target's features from a vLLM engine against the
in-process transformers forward, on CPU (target.backend, flashdraft.target.engine).

Two parts, each on random-weight Qwen3 targets of the chosen sizes (``--sizes``):

1. features: ``--samples`` samples of ``--length`` random tokens in batches of ``--batch``, through
   TargetModel.features (in-process, ``--threads`` torch threads) and EngineTarget.features (vLLM's
   CPU build in its own process, its own thread binding), each after one warm-up batch, the
   engine's start-up timed apart; ``--repeats`` passes of each, alternating, and their medians.
   Reported: tokens/s and samples/s of each, their ratio (the median pair's), tokens per CPU
   second (both processes' CPU time: what moves least when other jobs share the cores), the engine's split
   (waiting on its prefills vs copying the captures in), the bytes that cross between the
   processes per sample (the captured states, written once by the engine into a tmpfs and read
   once here, and the ids sent), and the largest errors per tap against the in-process forward
   (flashdraft.target.feature_check).
2. overlap (``--train-steps`` > 0): the real trainer with each backend, sequential and pipelined
   (the engine's prefill of step n + 1 overlapping the drafter's step n), steps/s, the bound, the
   efficiency (pipelined / 1 over the slowest stage measured sequentially) and the stage table.

On a machine of few cores both processes share them, and other jobs share them too: each figure
comes with the load average it was taken under.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

# name -> (vocab, layers, hidden, query heads, KV heads, MLP, taps); head_dim >= 32 (vLLM's CPU attention)
SIZES = {
    "quickstart": (1100, 4, 128, 4, 2, 256, [1, 2]),  # the quickstart target's shape and taps
    "h1024": (32000, 8, 1024, 16, 8, 3072, [1, 3, 5]),  # hidden 1024, 8 layers, Qwen3-0.6B's head shape
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="quickstart,h1024", help=f"targets to measure: {', '.join(SIZES)}")
    parser.add_argument("--samples", type=int, default=64, help="samples per pass")
    parser.add_argument("--length", type=int, default=256, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=16, help="samples per features call (one engine request each)")
    parser.add_argument("--repeats", type=int, default=5, help="passes per backend, alternating; medians reported")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the in-process forward (the engine binds its own)")
    parser.add_argument("--taps", default="", help="tapped layers for every size, e.g. 1,3,6 (default: each size's)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="steps per trainer run of the overlap part (0: skip it; 24 measures it)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")


def build_target(root: Path, name: str) -> Path:
    from flashdraft.toy import tiny_causal_lm

    vocab, layers, hidden, heads, kv_heads, mlp, _ = SIZES[name]
    model = tiny_causal_lm(vocab, "qwen3", num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
                           intermediate=mlp, max_position_embeddings=4096, seed=0)
    model.save_pretrained(root / name)
    return root / name


def _cpu_s(pid: int | None) -> float:
    """CPU seconds used so far by this process, plus by process ``pid`` (the engine) when given."""
    import psutil

    used = time.process_time()
    if pid is not None:
        times = psutil.Process(pid).cpu_times()
        used += times.user + times.system
    return used


def _pass(features, batches, engine_pid: int | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of both processes) of one pass over ``batches``: the CPU time
    moves much less than the wall time when other jobs share the cores."""
    begin, cpu = time.perf_counter(), _cpu_s(engine_pid)
    for batch in batches:
        features(*batch)
    return time.perf_counter() - begin, _cpu_s(engine_pid) - cpu


def measure_features(target_dir: Path, taps: list[int], args) -> dict:
    """Both backends on the same batches, passes alternating (in-process, engine, in-process, ...)
    so that a change in the machine's load falls on both; medians, and the median of the pairs'
    ratios."""
    from flashdraft.target import TargetModel
    from flashdraft.target.engine import EngineTarget
    from flashdraft.target.feature_check import check_engine_features

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    vocab = SIZES[target_dir.name][0]
    ids = torch.randint(0, vocab, (args.samples, args.length), generator=gen)
    batches = [(ids[i:i + args.batch], torch.ones_like(ids[i:i + args.batch]))
               for i in range(0, args.samples, args.batch)]
    tokens = args.samples * args.length
    local = TargetModel.from_pretrained(target_dir, target_layer_ids=taps, dtype="float32")
    begin = time.perf_counter()
    engine = EngineTarget.from_pretrained(target_dir, target_layer_ids=taps, dtype="float32",
                                          max_model_len=args.length + 1)
    start_s = time.perf_counter() - begin
    try:
        check = check_engine_features(engine, local, ids[:4].tolist())
        local.features(*batches[0]), engine.features(*batches[0])  # warm-up
        stats = engine.engine.stats
        before = (stats.prefill_s, stats.read_s, stats.requests, stats.feature_bytes, stats.id_bytes)
        load = os.getloadavg()[0]
        pid = engine.engine.process.pid
        pairs = [(_pass(local.features, batches), _pass(engine.features, batches, pid)) for _ in range(args.repeats)]
        prefill_s, read_s, requests, feature_bytes, id_bytes = (now - was for now, was in zip(
            (stats.prefill_s, stats.read_s, stats.requests, stats.feature_bytes, stats.id_bytes), before))
    finally:
        engine.close()
    local_s, local_cpu, engine_s, engine_cpu = (statistics.median(pair[side][what] for pair in pairs)
                                                for side in (0, 1) for what in (0, 1))
    return {"tokens_per_s": {"in_process": tokens / local_s, "engine": tokens / engine_s},
            "tokens_per_cpu_s": {"in_process": tokens / local_cpu, "engine": tokens / engine_cpu},
            "samples_per_s": {"in_process": args.samples / local_s, "engine": args.samples / engine_s},
            "ratio": statistics.median(a[0] / b[0] for a, b in pairs),
            "cpu_ratio": statistics.median(a[1] / b[1] for a, b in pairs), "pairs": pairs,
            "engine_start_s": start_s,
            "load_1min": (load, os.getloadavg()[0]),
            # the engine's time: waiting on its prefills vs copying the captures in
            "engine_prefill_share": prefill_s / (prefill_s + read_s),
            "engine_read_share": read_s / (prefill_s + read_s),
            "bytes_per_sample": {"features": feature_bytes / requests, "ids": id_bytes / requests},
            "relative_error": {t["layer"]: t["relative_error"] for t in check["taps"]},
            "max_abs_error": {t["layer"]: t["max_abs_error"] for t in check["taps"]}}


def measure_overlap(target_dir: Path, taps: list[int], backend: str, pipelined: bool, steps: int, root: Path,
                    out: Path, threads: int) -> dict:
    """The real trainer on ``target_dir`` with random data (made once in ``root``), its output in
    ``out``: steps/s (warm-up steps excluded) and the run's stage report."""
    from transformers import AutoModelForCausalLM

    from flashdraft.bench.jobs import StepClock, trainer_for, write_job

    torch.set_num_threads(threads)
    job = root / "job"
    if not (job / "data").exists():
        write_job(job, AutoModelForCausalLM.from_pretrained(target_dir), samples=64, length=256, prompt_length=64,
                  max_id=SIZES[target_dir.name][0] - 2)
    overrides = {
        "target.path": job / "target", "drafter.mask_token_id": SIZES[target_dir.name][0] - 1,
        "drafter.num_layers": 1, "drafter.block_size": 8, "target.layer_ids": json.dumps(taps),
        "target.backend": backend, "data.path": job / "data", "data.token_budget": 2048,
        "data.max_batch_size": 8, "objective.num_anchors": 32, "train.max_steps": steps, "train.log_every": steps,
        "checkpoint.save_every": 0, "train.output_dir": out, "train.device": "cpu", "train.metrics": "[jsonl]",
        "checkpoint.resume": "never", "pipeline.enabled": str(pipelined).lower(),
    }
    trainer, clock = trainer_for(overrides), StepClock()
    try:
        trainer.fit(on_step=clock)
    finally:
        if hasattr(trainer.target, "close"):
            trainer.target.close()
    return {"steps_per_s": clock.steady_rate(min(3, steps // 3)), "report": trainer.pipeline_report}


def run(args) -> int:
    import logging
    import subprocess

    logging.basicConfig(level=logging.WARNING)
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"engine vs in-process features, CPU, fp32, {args.samples} samples x {args.length} tokens, batches of "
          f"{args.batch}; in-process {args.threads} threads; load: {load}")
    results: dict = {"load_before": load, "settings": vars(args).copy(), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="flashdraft-bench-engine-") as tmp:
        for name in args.sizes.split(","):
            taps = [int(t) for t in args.taps.split(",")] if args.taps else SIZES[name][-1]
            target_dir = build_target(Path(tmp), name)
            row = measure_features(target_dir, taps, args)
            results["sizes"][name] = row
            tps, bps = row["tokens_per_s"], row["bytes_per_sample"]
            print(f"\n{name} (taps {taps}): in-process {tps['in_process']:,.0f} tok/s, engine {tps['engine']:,.0f} "
                  f"tok/s ({row['ratio']:.2f}x, the median pair; engine start {row['engine_start_s']:.0f} s, excluded; "
                  "load average %.1f -> %.1f)" % row["load_1min"])
            # the engine runs every layer (and the last token's head); in-process stops after the last tap
            layers = SIZES[name][1]
            row["layer_ratio"] = (max(taps) + 1) / layers
            print(f"  layers computed: in-process {max(taps) + 1} of {layers} (it stops after the last tap), the "
                  f"engine all {layers}: at equal speed per layer the engine would reach {row['layer_ratio']:.2f}x; "
                  f"per layer it runs at {row['ratio'] / row['layer_ratio']:.2f}x")
            cpu = row["tokens_per_cpu_s"]
            print(f"  per CPU second (both processes): in-process {cpu['in_process']:,.0f} tok, engine "
                  f"{cpu['engine']:,.0f} tok ({row['cpu_ratio']:.2f}x)")
            print(f"  engine time: {100 * row['engine_prefill_share']:.0f}% waiting on its prefills, "
                  f"{100 * row['engine_read_share']:.0f}% copying the captures in")
            print(f"  bytes crossing per sample: {bps['features']:,.0f} of captured states (written once, read once) "
                  f"+ {bps['ids']:,.0f} of ids")
            print("  largest error per tap vs in-process (relative per token row / absolute): " + ", ".join(
                f"layer {k}: {v:.1e} / {row['max_abs_error'][k]:.1e}" for k, v in row["relative_error"].items()))
            if args.train_steps:
                results["sizes"][name]["overlap"] = _overlap_part(target_dir, taps, args, Path(tmp) / f"{name}-train")
    results["load_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"\nload after: {results['load_after']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


def _overlap_part(target_dir: Path, taps: list[int], args, root: Path) -> dict:
    """Each backend's trainer sequential and pipelined, in ABBA order (a drift in the machine's load
    falls on both modes); medians. The ideal is 1 / the slowest stage of the sequential runs."""
    found = {}
    for backend in ("transformers", "vllm"):
        runs = {False: [], True: []}
        for i, pipelined in enumerate((False, True, True, False)):
            runs[pipelined].append(measure_overlap(target_dir, taps, backend, pipelined, args.train_steps, root,
                                                   root / f"run-{backend}-{i}", args.threads))
        rate = {p: statistics.median(r["steps_per_s"] for r in runs[p]) for p in runs}
        ideal = statistics.median(r["report"].ideal_items_per_s for r in runs[False])
        found[backend] = {"sequential_steps_per_s": rate[False], "pipelined_steps_per_s": rate[True],
                          "ideal_steps_per_s": ideal, "efficiency": rate[True] / ideal if ideal else None,
                          "bound": runs[True][-1]["report"].bound,
                          "sequential_report": runs[False][-1]["report"].format(),
                          "pipelined_report": runs[True][-1]["report"].format()}
        row = found[backend]
        print(f"  trainer, {backend}: sequential {rate[False]:.2f} steps/s, pipelined {rate[True]:.2f} (ideal "
              f"{ideal:.2f}, efficiency {row['efficiency']:.2f}, {row['bound']}; medians of 2 runs each, ABBA)")
        for mode in ("sequential", "pipelined"):
            print("    " + row[f"{mode}_report"].replace("\n", "\n    "))
    return found
