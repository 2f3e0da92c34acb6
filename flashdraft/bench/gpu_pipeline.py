"""`flashdraft bench gpu-pipeline`: GPU check of the pipeline (one prepared run, <= 8 minutes on
one H200; NOT run yet).

Trains a DFlash drafter against a random-weight Qwen3-0.6B-shaped target in bf16: 3 discarded
warm-up steps (flex_attention compiles), then sequential (pipeline.enabled=false) and
pipelined, same seed and steps, and records per mode: steps/s,
tokens/s, GPU busy share (nvidia-smi utilization sampled every 100 ms), the trainer's stage
timing and the pipeline's busy / starved / blocked split with its bound; and whether the two
modes gave the same losses. Writes JSON to $OUT/gpu_pipeline.json (or ./gpu_pipeline.json).

    flashdraft bench gpu-pipeline [--steps 40] [--layers 28]

``--smoke`` runs the same benchmark on CPU at toy sizes in seconds (tests/test_gpu_scripts.py),
so the one GPU run a session may get is not spent on a broken script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from flashdraft.bench.jobs import StepClock, gpu_job, trainer_for
from flashdraft.outputs import write_report


def gpu_sampler(stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """(time, GPU utilization %) every 100 ms (nvidia-smi: no extra Python dependency)."""
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                  "-i", "0"], capture_output=True, text=True, timeout=5).stdout
            samples.append((time.perf_counter(), float(out.strip().splitlines()[0])))
        except Exception:  # utilization is best effort
            return
        stop.wait(0.1)


def run_mode(root: Path, enabled: bool, steps: int, layers: int, device: str = "cuda", budget: int = 16384,
             anchors: int = 512, name: str = "") -> dict:
    from transformers import AutoConfig

    from flashdraft.target import default_target_layer_ids

    taps = default_target_layer_ids(layers, 5)  # DFlash's spread, as for Qwen3-8B
    vocab = AutoConfig.from_pretrained(root / "target").vocab_size  # the last id is the MASK token
    overrides = {
        "target.path": root / "target", "drafter.mask_token_id": vocab - 1, "drafter.num_layers": 5,
        "drafter.block_size": 16, "target.layer_ids": json.dumps(taps), "data.path": root / "data",
        "data.token_budget": budget, "data.max_batch_size": 8, "objective.num_anchors": anchors,
        "train.max_steps": steps, "train.log_every": min(10, max(1, steps // 3)), "checkpoint.save_every": 0,
        "train.output_dir": root / (name or f"run_{enabled}"), "checkpoint.resume": "never", "train.device": device,
        "pipeline.enabled": str(enabled).lower(),
    }
    trainer, clock = trainer_for(overrides), StepClock()
    util: list[tuple[float, float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=gpu_sampler, args=(stop, util), daemon=True)
    sampler.start()
    trainer.fit(on_step=clock)
    stop.set()
    sampler.join(2)
    skip = min(5, steps // 3)  # warm-up: allocator, cuBLAS handles, first-call overheads
    stamps, rate = clock.stamps, clock.steady_rate(skip)
    util = [u for t, u in util if stamps[skip] <= t <= stamps[-1]]  # the timed steps only
    tokens_per_step = int(trainer.dataset.lengths.sum()) / trainer.sampler.batches_per_epoch
    report = trainer.pipeline_report
    return {
        "pipelined": enabled, "steps_per_s": rate, "tokens_per_s": rate * tokens_per_step,
        "gpu_busy_share": (sum(util) / len(util) / 100) if util else None,
        "losses": [h["loss"] for h in trainer.history if "loss" in h],
        "stage_timing_last_log": {k: v for k, v in trainer.history[-1].items() if k.startswith("time/")},
        "pipeline": {"bound": report.bound, "table": report.format(), **report.as_metrics()},
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=28, help="target layers (Qwen3-0.6B: 28)")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes (overrides --steps, --layers, --samples, "
                        "--length): check the benchmark itself in seconds")


def run(args) -> int:
    if args.smoke:
        args.steps, args.layers, args.samples, args.length = 6, 8, 8, 128
        sizes = dict(vocab=512, hidden=128)
        mode = dict(device="cpu", budget=256, anchors=8)
    else:
        assert torch.cuda.is_available(), "this check needs a GPU"
        sizes, mode = {}, {}
    out = Path(os.environ.get("OUT", "."))
    device_name = torch.cuda.get_device_name(0) if not args.smoke else "cpu (smoke)"
    results = {"device": device_name, "torch": torch.__version__, "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gpu_job(root, args.layers, args.samples, args.length, **sizes)
        # A few discarded steps first: flex_attention's compile (forward and backward, ~1 min)
        # and cuBLAS / allocator warm-up would otherwise land in the first mode's stage split.
        run_mode(root, True, 3, args.layers, name="warm_up", **mode)
        for enabled in (False, True):
            if not args.smoke:
                gc.collect()  # the previous mode's trainer
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            results["pipelined" if enabled else "sequential"] = r = run_mode(root, enabled, args.steps, args.layers,
                                                                             **mode)
            print(f"{'pipelined' if enabled else 'sequential'}: {r['steps_per_s']:.3f} steps/s, "
                  f"{r['tokens_per_s']:.0f} tok/s, GPU busy {r['gpu_busy_share']}, {r['pipeline']['bound']}\n"
                  f"{r['pipeline']['table']}", flush=True)
    seq, pipe = results["sequential"], results["pipelined"]
    results["speedup"] = pipe["steps_per_s"] / seq["steps_per_s"]
    # bf16 on GPU: same seed and data, but kernels may differ in reduction order across streams.
    results["max_loss_diff"] = max(abs(a - b) for a, b in zip(seq["losses"], pipe["losses"]))
    write_report(out / "gpu_pipeline.json", json.dumps(results, indent=1), flag="--out")
    print(f"speedup {results['speedup']:.2f}x, max loss diff {results['max_loss_diff']:.3g} -> "
          f"{out / 'gpu_pipeline.json'}")
    return 0
