"""`flashdraft bench NAME [options]`: benchmarks, one module per sub-benchmark.

Each entry of SUBBENCHES maps a name to a module exposing ``add_arguments(parser)`` and
``run(args)`` (like CLI commands); add a line here to add a benchmark (train, step, pipeline...).
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help)
SUBBENCHES: dict[str, tuple[str, str]] = {
    "data": ("flashdraft.data.bench", "data path: seed-style HF dataset vs flashdraft shard (ready, gather+pad, plan, RSS)"),
    "step": ("flashdraft.benchmarks.step", "drafter step: fast attention path vs dense-mask reference (time, peak memory)"),
    "train": ("flashdraft.benchmarks.train", "the real trainer on a fixed tiny config: steps/s, tokens/s, stage split"),
    "pipeline": ("flashdraft.benchmarks.pipeline", "pipelined vs sequential stages: synthetic costs and the real trainer"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(SUBBENCHES), help="which benchmark: " + "; ".join(
        f"{k}: {v[1]}" for k, v in SUBBENCHES.items()))
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark (NAME --help)")


def run(args) -> int:
    module_name, doc = SUBBENCHES[args.name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"flashdraft bench {args.name}", description=doc)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.options)) or 0)
