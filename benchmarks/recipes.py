"""The recipe table (docs/recipes.md): objectives and drafter families compared on the quickstart's
job, several seeds each, at equal steps, by the real draft / verify tau.

    flashdraft quickstart --output runs/quickstart          # once: target, data, prompts
    python benchmarks/recipes.py runs/quickstart --out runs/recipes [--seeds 0 1 2] [--variants ...]

Each variant trains the quickstart's drafter (its run/config.yaml, ``train.seed`` = the seed) with
its own config keys, then ``flashdraft eval`` decodes the held-out prompts greedily and sampled
(T = 0.7, the seed as the sampling seed). The table gives each variant's per-prompt and pooled tau,
mean and spread (sample standard deviation) over the seeds, for both decodings, and its drafter's
parameter count; every run's numbers go to OUT/results.json. A finished run is not trained again
(delete its directory to redo it). Not part of the suite: minutes per run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# The variants: name -> the config keys it sets on top of the quickstart's own run.
SOFT = {"objective.kd_weight": 0.5}
AUF = {"objective.accept_until_fail": "true"}
VARIANTS = {
    "ce": {},  # the quickstart's: hard labels, decay weights
    "kd": SOFT,
    "kd+auf": {**SOFT, **AUF},
    "kd+auf+dpace": {**SOFT, **AUF, "objective.weighting": "dpace"},
    "ce+auf": AUF,
    "kd1": {"objective.kd_weight": 1.0},
    # equal drafter parameters: DFlash with 2 layers against DFlash2 with 1 layer and a selector whose
    # codebooks hold about what the second layer holds (its rank from --dflash2-rank)
    "dflash-2layers": {"drafter.num_layers": 2},
    "dflash2-1layer": {"drafter.family": "dflash2", "drafter.conv_group_size": 16, "drafter.selector_top_k": 16},
}
DEFAULT = ["ce", "kd", "kd+auf", "kd+auf+dpace"]


def run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode not in (0, 1):  # eval exits 1 when a decode was not lossless: reported, not fatal
        sys.exit(f"{' '.join(cmd[:3])} failed ({done.returncode}); see {log}")


def parameters(drafter_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(drafter_dir / "model.safetensors", "pt") as f:
        total = 0
        for key in f.keys():
            numel = 1
            for size in f.get_slice(key).get_shape():
                numel *= size
            total += numel
    return total


def one(quickstart: Path, out: Path, name: str, keys: dict, seed: int, max_new_tokens: int) -> dict:
    """Train and evaluate one variant at one seed (or read what an earlier call left)."""
    home = out / f"{name}-seed{seed}"
    done = home / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    home.mkdir(parents=True, exist_ok=True)
    log = home / "log.txt"
    settings = {"train.output_dir": home / "run", "train.seed": seed, "eval.every": 0,
                "eval.prompts_path": "", "eval.data_path": "", "checkpoint.resume": "never", **keys}
    run([sys.executable, "-m", "flashdraft.cli", "train", "--config", str(quickstart / "run" / "config.yaml"),
         *[f"{k}={v}" for k, v in settings.items()]], log)
    result = {"variant": name, "seed": seed, "keys": keys, "parameters": parameters(home / "run" / "drafter")}
    for mode, extra in (("greedy", []), ("sampled", ["--temperature", "0.7", "--seed", str(seed)])):
        report = home / f"{mode}.json"
        run([sys.executable, "-m", "flashdraft.cli", "eval", "--target", str(quickstart / "target"), "--drafter",
             str(home / "run" / "drafter"), "--prompts", str(quickstart / "eval" / "prompts.jsonl"),
             "--max-new-tokens", str(max_new_tokens), "--device", "cpu", "--output", str(report), *extra], log)
        found = json.loads(report.read_text())
        result[mode] = {"tau": found["tau"], "tau_pooled": found["tau_pooled"], "lossless": found.get("lossless")}
    done.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _cell(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {spread:.3f}"


def table(results: list[dict]) -> str:
    """The markdown table: per variant, mean +- spread over seeds of each tau."""
    rows = ["| variant | seeds | drafter parameters | greedy tau | greedy tau (pooled) | T=0.7 tau | "
            "T=0.7 tau (pooled) |", "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["variant"] for r in results):
        mine = [r for r in results if r["variant"] == name]
        cells = [_cell([r[mode][key] for r in mine]) for mode in ("greedy", "sampled") for key in ("tau", "tau_pooled")]
        rows.append(f"| {name} | {len(mine)} | {mine[0]['parameters']:,} | {' | '.join(cells)} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("quickstart", type=Path, help="a quickstart's --output directory")
    parser.add_argument("--out", type=Path, default=Path("runs/recipes"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=DEFAULT, choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, help="train.max_steps (default: the quickstart's)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dflash2-rank", type=int, default=96, help="dflash2-1layer's selector rank")
    args = parser.parse_args()
    results = []
    for name in args.variants:
        keys = dict(VARIANTS[name])
        if name == "dflash2-1layer":
            keys["drafter.selector_rank"] = args.dflash2_rank
        if args.steps:
            keys["train.max_steps"] = args.steps
        for seed in args.seeds:
            results.append(one(args.quickstart, args.out, name, keys, seed, args.max_new_tokens))
            print(f"{name} seed {seed}: greedy tau {results[-1]['greedy']['tau']:.3f}, "
                  f"T=0.7 tau {results[-1]['sampled']['tau']:.3f}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
