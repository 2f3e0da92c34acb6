"""`flashdraft bench NAME [options]`: every benchmark of the project, one module per sub-benchmark.

Each entry of SUBBENCHES maps a name to a module of this package exposing ``add_arguments(parser)``
and ``run(args)`` (like CLI commands); add a line here to add a benchmark. Only the chosen
benchmark's module is imported. The tiny training jobs they share live in ``flashdraft.bench.jobs``.
"""

from __future__ import annotations

import argparse
import importlib
import signal

# name -> one-line help; the benchmark's module is flashdraft.bench.<name, "-" read as "_">
SUBBENCHES: dict[str, str] = {
    "data": "data path: seed-style HF dataset vs flashdraft shard (ready, gather+pad, plan, RSS)",
    "prepare": "flashdraft prepare throughput on synthetic chats: 1 worker vs all cores",
    "step": "drafter step: fast attention path vs dense-mask reference (time, peak memory)",
    "train": "the real trainer on a fixed tiny config: steps/s, tokens/s, stage split",
    "pipeline": "pipelined vs sequential stages: synthetic costs and the real trainer",
    "soak": "thousands of tiny CPU steps with checkpoints and evals: RSS, fds, threads over time",
    "gpu-pipeline": "GPU: the trainer sequential vs pipelined on a Qwen3-0.6B-shaped target (--smoke: on CPU)",
    "plan": "the memory plan of public targets' config.json files at several lengths and device sizes",
    "gpu-check": "GPU: parts of benchmarks/gpu_checks.sh (the one-GPU check; --smoke: on CPU)",
    "engine-features": "the target's features from a vLLM engine vs the in-process forward (CPU): rate, bytes, overlap",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(SUBBENCHES), help="which benchmark: " + "; ".join(
        f"{k}: {v}" for k, v in SUBBENCHES.items()))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark (NAME --help)")


def run(args) -> int:
    from flashdraft.signals import Stopped

    doc = SUBBENCHES[args.name]
    module = importlib.import_module(f"{__name__}.{args.name.replace('-', '_')}")
    parser = argparse.ArgumentParser(prog=f"flashdraft bench {args.name}", description=doc)
    module.add_arguments(parser)
    options = parser.parse_args(args.options)
    if getattr(options, "json", ""):  # refused now, not after the benchmark's minutes (flashdraft.outputs)
        from flashdraft.outputs import check_report

        check_report(options.json, flag="--json")

    def stop(signum, frame):  # outside a training loop: end now (subprocess.run kills its worker on the way out)
        raise Stopped(signum, "")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return int(module.run(options) or 0)
    except Stopped as exc:  # a benchmark's trainer run or worker stopped by a signal: the benchmark ends with it
        raise Stopped(exc.signum, f"stopped by {signal.Signals(exc.signum).name}: the benchmark ended there "
                                  "(nothing to resume: it starts over when run again)") from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
