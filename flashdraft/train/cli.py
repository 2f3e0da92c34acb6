"""`flashdraft train`: the command line of the trainer."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_arguments(parser) -> None:
    from flashdraft.config import describe_fields

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (describe_fields() + "\n\n`flashdraft config [--config FILE] [overrides]` prints the resolved "
                     "config as YAML (a starting file: flashdraft config > run.yaml).")
    parser.add_argument("--config", help="YAML config file (sections model, data, objective, optim, train, pipeline)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 target.path=DIR")


def run(args) -> int:
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_config(args.config, args.overrides)
    result = train(config).metrics
    if int(os.environ.get("RANK", "0")) == 0:  # the process group is already torn down here
        keys = ("loss", "acc", "tau_sim", "eval_loss", "eval_tau", "eval_tau_pooled", "tokens_per_s", "skipped_steps")
        print("final: " + " ".join(f"{k} {result[k]:.4g}" for k in keys if isinstance(result.get(k), int | float)),
              file=sys.stderr)
    return 0
