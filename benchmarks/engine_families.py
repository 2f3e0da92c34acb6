"""Each drafter family through vLLM's CPU build and the DFlash reference decoder: the figures of
docs/benchmarks.md, "Served by vLLM".

    python benchmarks/engine_families.py OUT_DIR [--only vllm|reference] [dflash swa sinks dflash2]

Builds tests/test_judge.py's job in OUT_DIR (a tiny Qwen3 target, head_dim 32, and its greedy
continuations), trains a 150-step drafter of each family on it, and runs flashdraft.judge.engine's
engine check of every export, in one engine call, on 8 training prompts (40 new tokens, no eos,
greedy, fp32). Writes OUT_DIR/engine-FAMILY.json and prints each verdict; then
flashdraft.judge.reference's check of each export on the same prompts with the DFlash authors'
reference decoder (OUT_DIR/reference-FAMILY.json).
Needs the engine environment (created on first use, vllm_env.engine_python; dflash installed there
by reference.reference_python).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FAMILIES = {
    "dflash": {},
    "swa": {"drafter__layer_types": '["sliding_attention"]', "drafter__sliding_window": 16,
            "drafter__causal": "false"},
    "sinks": {"drafter__attention_sink": "true"},
    "dflash2": {"drafter__family": "dflash2"},
}


def main(out: Path, names: list[str], only: str | None = None) -> None:
    from conftest import make_job, overrides
    from flashdraft.config import load_config
    from flashdraft.judge.engine import engine_checks, format_check
    from flashdraft.judge.reference import format_reference, reference_check
    from flashdraft.toy import tiny_causal_lm
    from flashdraft.train.trainer import train

    if not (out / "target" / "config.json").is_file():
        model = tiny_causal_lm(300, arch="qwen3", num_layers=4, hidden=64, num_heads=2, num_kv_heads=1, seed=1,
                               max_position_embeddings=512,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        make_job(out, model)
    prompts = torch.randint(0, 298, (40, 6), generator=torch.Generator().manual_seed(0))[:8].tolist()
    runs = {}
    for name in names:
        runs[name] = out / f"run-{name}" / "drafter"
        if not (runs[name] / "config.json").is_file():
            train(load_config(None, overrides(out, runs[name].parent, train__max_steps=150, drafter__block_size=8,
                                              optim__lr="1e-2", data__token_budget=640, data__max_batch_size=16,
                                              objective__num_anchors=16, **FAMILIES[name])))
    if only != "reference":  # every family in one engine call: vLLM starts once
        begin = time.perf_counter()
        reports = engine_checks(out / "target", list(runs.values()), prompts, max_new_tokens=40, eos_ids=[])
        seconds = round(time.perf_counter() - begin, 1)
        for name, report in zip(runs, reports):
            report["seconds_all_families"] = seconds
            (out / f"engine-{name}.json").write_text(json.dumps(report, indent=1) + "\n")
            print(f"== {name}: vLLM\n{format_check(report)}", flush=True)
    if only != "vllm":
        for name, drafter in runs.items():
            begin = time.perf_counter()
            report = reference_check(out / "target", drafter, prompts, max_new_tokens=40, eos_ids=[])
            report["seconds"] = round(time.perf_counter() - begin, 1)
            (out / f"reference-{name}.json").write_text(json.dumps(report, indent=1) + "\n")
            print(f"== {name}: DFlash reference decoder\n{format_reference(report)}", flush=True)

if __name__ == "__main__":
    args = sys.argv[2:]
    only = None
    if args[:1] == ["--only"]:
        only, args = args[1], args[2:]
        if only not in ("vllm", "reference"):
            sys.exit(f"--only takes vllm or reference, not {only!r}")
    main(Path(sys.argv[1]), args or list(FAMILIES), only)
