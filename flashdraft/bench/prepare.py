"""`flashdraft bench prepare`: `flashdraft prepare` throughput on synthetic conversations, 1
worker vs all cores.

    flashdraft bench prepare --samples 100000 --workdir /tmp/bench-prepare
    flashdraft bench prepare --samples 5000 --max-turns 16 --workers 1   # long conversations

Prints one JSON line per run (samples/s, tokens/s, seconds) and the speed-up. The machine's
load average and the CPU seconds used (main process + workers) are printed too: on a shared
machine other jobs change the wall-clock numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from flashdraft.data.prepare import prepare
from flashdraft.toy import synthetic_conversations, train_toy_tokenizer


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=100_000, help="synthetic conversations to prepare")
    parser.add_argument("--workdir", default="/tmp/bench-prepare",
                        help="where the chats, the tokenizer (both reused across runs) and the shards go")
    parser.add_argument("--workers", default=f"1,{os.cpu_count()}", help="comma list of worker counts, one run each")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size of the toy BPE tokenizer")
    parser.add_argument("--max-turns", type=int, default=3,
                        help="user/assistant pairs per conversation: 1 to this many (long agentic chats: 16+)")


def run(args) -> int:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / (f"chats-{args.samples}.jsonl" if args.max_turns == 3 else
                   f"chats-{args.samples}-turns{args.max_turns}.jsonl")
    if not data.exists():
        records = synthetic_conversations(args.samples, seed=0, max_turns=args.max_turns)
        with open(data, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    tok_dir = work / "tokenizer"
    if not tok_dir.exists():
        corpus = [m["content"] for r in synthetic_conversations(2000, seed=1) for m in r["messages"]]
        train_toy_tokenizer(corpus, args.vocab, template="qwen3").save_pretrained(tok_dir)
    results = {}
    for w in [int(x) for x in args.workers.split(",")]:
        t0 = time.perf_counter()
        cpu0 = _cpu_seconds()
        s = prepare([data], tok_dir, work / f"shard-w{w}", max_length=3072, min_supervised=32, num_workers=w,
                    force=True, progress=False, log=lambda *_: None)
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0  # main process + (reaped) workers
        results[w] = s
        print(json.dumps({"workers": w, "samples_in": s["samples_in"], "samples": s["samples"], "tokens": s["tokens"],
                          "seconds": round(wall, 1), "samples_per_s": round(s["samples_in"] / wall),
                          "tokens_per_s": round(s["tokens"] / wall), "cpu_seconds": round(cpu, 1),
                          "samples_per_cpu_s": round(s["samples_in"] / cpu), "loadavg": os.getloadavg()}), flush=True)
    ws = sorted(results)
    if len(ws) > 1:
        print(json.dumps({"speedup": round(results[ws[0]]["seconds"] / results[ws[-1]]["seconds"], 2)}))
        # On a shared machine wall time depends on other jobs; CPU time per sample does not.
    return 0
