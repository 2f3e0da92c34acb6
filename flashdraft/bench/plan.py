"""`flashdraft bench plan`: the memory plan's tables of public targets (docs/memory.md).

For each target directory holding a config.json (tests/fixtures/configs keeps six public
ones), the plan (flashdraft.train.plan) with the default run config at each padded length, on each
device size: the per-device peak, its largest consumers and the verdict. Only config.json is
read; each plan runs one fake drafter step (seconds).
"""

from __future__ import annotations

import logging
from pathlib import Path

# the sharding each public target needs (colocated: every GPU holds its share of the target)
LAYOUTS = {"Qwen3-32B": ["target.tensor_parallel=2"],
           "Qwen3-30B-A3B": ["target.tensor_parallel=2", "target.expert_parallel=true"],
           "Qwen3-235B-A22B": ["target.tensor_parallel=4", "target.expert_parallel=true"],
           "gpt-oss-120b": ["target.tensor_parallel=4"]}


def add_arguments(parser) -> None:
    parser.add_argument("--targets", default="tests/fixtures/configs",
                        help="a folder of target directories, each with a config.json")
    parser.add_argument("--lengths", default="512,2048,8192", help="padded lengths S, comma-separated")
    # what CUDA reports for an 80 GB H100 and a 141 GB H200
    parser.add_argument("--devices", default="79.6,140.4", help="device sizes in GiB, comma-separated")
    parser.add_argument("overrides", nargs="*", help="run config overrides for every plan, e.g. data.row_budget=8192")


def run(args) -> int:
    from flashdraft.config import load_config
    from flashdraft.train.plan import GiB, MemoryPlan, plan_memory

    logging.getLogger("flashdraft").setLevel(logging.WARNING)
    lengths = [int(s) for s in args.lengths.split(",")]
    devices = [float(d) for d in args.devices.split(",")]
    head = " | ".join(f"{d:g} GiB" for d in devices)
    print(f"| target (layout) | S | B | rows / GPU | peak GiB | target | drafter state | activations | {head} |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(devices))
    for target in sorted(p for p in Path(args.targets).iterdir() if (p / "config.json").is_file()):
        layout = LAYOUTS.get(target.name, [])
        for s in lengths:
            cfg = load_config(None, [f"target.path={target}", "drafter.mask_token_id=0",
                                     f"data.max_length={max(s, 3072)}", *layout, *args.overrides])
            plan = plan_memory(cfg, seq_len=s, device="cuda")
            parts = dict(plan.consumers)
            weights = sum(v for k, v in parts.items() if k.startswith("target weights"))
            state = sum(parts.get(k, 0) for k in ("drafter weights (fp32 master)", "drafter gradients (fp32)",
                                                   "AdamW state (fp32)", "bf16 autocast weight cache"))
            acts = sum(v for k, v in parts.items() if "activations" in k or "chunk" in k)
            verdicts = " | ".join("fits" if plan.peak_bytes <= d * GiB * (1 - MemoryPlan.MARGIN) else "**no**"
                                  for d in devices)
            name = f"{target.name} ({', '.join(o.split('.', 1)[1] for o in layout) or 'one GPU'})"
            print(f"| {name} | {s} | {plan.batch_size} | {plan.rows} | {plan.peak_bytes / GiB:.1f} | "
                  f"{weights / GiB:.1f} | {state / GiB:.1f} | {acts / GiB:.1f} | {verdicts} |")
    return 0
