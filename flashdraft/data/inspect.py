"""`flashdraft inspect PATH`: what a training dataset holds and what training on it will cost.

Accepts everything ``open_dataset`` does (token shard, HF save_to_disk dir, parquet). Prints
samples, tokens, supervised share, length percentiles, the batch plan's padding waste at the
configured budget, problems found (as counts with example sample indices and the fix) and
how long the dataset took to get ready. Invalid samples are counted, not fatal, here.
"""

from __future__ import annotations

import json
import time

import numpy as np

from flashdraft.config import DataConfig, DrafterConfig


def add_arguments(parser) -> None:
    d, m = DataConfig(), DrafterConfig()
    parser.add_argument("path",
                        help="token shard, HF save_to_disk directory, parquet file or directory of parquet files")
    parser.add_argument("--vocab-size", type=int, default=None, help="target vocab size to check ids against")
    parser.add_argument("--max-length", type=int, default=d.max_length, help="data.max_length (truncation)")
    parser.add_argument("--token-budget", type=int, default=d.token_budget, help="data.token_budget")
    parser.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="data.max_batch_size")
    parser.add_argument("--min-supervised", type=int, default=None,
                        help=f"data.min_supervised (default 2 * block_size = {2 * m.block_size})")
    parser.add_argument("--cache-dir", default=None, help="where converted sources are cached")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def summarize(path, *, vocab_size=None, max_length=3072, token_budget=16384, max_batch_size=64,
              min_supervised=32, cache_dir=None) -> dict:
    """The inspect figures as a dict (see module docstring)."""
    from flashdraft.data.batching import budget_fill, build_batches, padding_waste
    from flashdraft.data.dataset import open_dataset

    t = time.perf_counter()
    ds = open_dataset(path, vocab_size=vocab_size, max_length=max_length, min_supervised=min_supervised,
                      on_invalid="drop", cache_dir=cache_dir)
    ready_s = time.perf_counter() - t
    out = {"path": str(path), "shard": str(ds.path), "ready_s": ready_s, "samples": len(ds),
           "samples_seen": ds.report.samples_seen, "tokens": ds.num_tokens, "vocab_size": ds.vocab_size,
           "ids_dtype": str(ds.ids.dtype), "truncated": ds.report.truncated, "max_length": max_length,
           "dropped": ds.report.dropped, "examples": ds.report.examples}
    if len(ds):
        supervised = int(ds.num_supervised().sum())
        pct = [0, 1, 10, 50, 90, 99, 100]
        out["supervised_tokens"] = supervised
        out["supervised_share"] = supervised / max(ds.num_tokens, 1)
        out["length_percentiles"] = dict(zip((f"p{p}" for p in pct),
                                             np.percentile(ds.lengths, pct).round().astype(int).tolist()))
        out["mean_length"] = float(ds.lengths.mean())
        t = time.perf_counter()
        try:
            plan = build_batches(ds.lengths, token_budget=token_budget, max_batch_size=max_batch_size, seed=0, epoch=0)
            out["plan"] = {"token_budget": token_budget, "max_batch_size": max_batch_size, "batches": len(plan),
                           "padding_waste": padding_waste(ds.lengths, plan),
                           "budget_fill": budget_fill(ds.lengths, plan, token_budget),
                           "plan_s": time.perf_counter() - t}
        except ValueError as exc:
            out["plan"] = {"error": str(exc)}
    return out


def format_summary(s: dict) -> str:
    lines = [f"{s['path']}" + (f"  (cached as {s['shard']})" if s["shard"] != s["path"] else ""),
             f"  ready in        {s['ready_s'] * 1e3:.1f} ms (open + validate)",
             f"  samples         {s['samples']:,} kept of {s['samples_seen']:,}",
             f"  tokens          {s['tokens']:,} (ids {s['ids_dtype']}, vocab_size {s['vocab_size']:,})"]
    if "supervised_share" in s:
        p = s["length_percentiles"]
        lines += [f"  supervised      {s['supervised_tokens']:,} tokens ({s['supervised_share']:.1%})",
                  f"  length          mean {s['mean_length']:.0f}; " + ", ".join(f"{k} {v:,}" for k, v in p.items()),
                  f"  truncated       {s['truncated']:,} samples to max_length {s['max_length']:,}"]
        plan = s["plan"]
        if "error" in plan:
            lines.append(f"  batch plan      cannot be built: {plan['error']}")
        else:
            lines.append(f"  batch plan      {plan['batches']:,} batches at token_budget {plan['token_budget']:,} / "
                         f"max_batch_size {plan['max_batch_size']}: padding waste {plan['padding_waste']:.2%}, "
                         f"budget fill {plan['budget_fill']:.1%} (planned in {plan['plan_s'] * 1e3:.0f} ms)")
    if s["dropped"]:
        from flashdraft.data.dataset import FIXES

        lines.append(f"  problems        {sum(s['dropped'].values()):,} samples would be rejected (training with "
                     "data.on_invalid=raise) or skipped (data.on_invalid=drop):")
        for kind, count in s["dropped"].items():
            lines.append(f"    {kind}: {count:,}, e.g. " + "; ".join(s["examples"].get(kind, [])[:3]))
            lines.append(f"      fix: {FIXES[kind]}")
    elif s["samples"] == 0:
        lines.append("  problems        the dataset has no samples: nothing to train on (check the source "
                     "and how it was prepared)")
    else:
        lines.append("  problems        none")
    return "\n".join(lines)


def run(args) -> int:
    min_sup = args.min_supervised if args.min_supervised is not None else 2 * DrafterConfig().block_size
    s = summarize(args.path, vocab_size=args.vocab_size, max_length=args.max_length, token_budget=args.token_budget,
                  max_batch_size=args.max_batch_size, min_supervised=min_sup, cache_dir=args.cache_dir)
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    return 0 if s["samples_seen"] else 1  # an empty source is an error; dropped samples are reported above
