"""`flashdraft bench data`: a naive data path against flashdraft's, in one run.

The naive baseline (called "seed" in the output) is the straightforward way to feed a
tokenized `datasets` dataset to training: preload every sample as its own tensor, fetch samples
one by one, and pad each batch with Python lists. The comparison shows what the token shard,
the batch plan and ``pad_batch`` save over it.

Builds a synthetic tokenized dataset (long-tailed lengths) in the baseline's form -- a `datasets`
save_to_disk directory with int64 list columns input_ids / loss_mask / seq_len -- converts it
once to flashdraft's token shard through ``open_dataset`` (the same path training uses), then
measures, each in a fresh subprocess with a warm page cache:

  seed:       load_from_disk + one torch.tensor per sample (timed on a subset, extrapolated),
              HF per-sample random access, the `.tolist()`-and-Python-lists padding collate
  flashdraft: imports, time-to-ready (open + validate), RSS growth from opening, batch plan for
              all samples, per-batch gather+pad of token-budget batches, peak RSS

and prints one markdown table with ratios. Generated data is reused across runs (same flags).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

SEED_SAMPLES = 902_087
QWEN_VOCAB = 151_936


def add_arguments(parser) -> None:
    parser.add_argument("--samples", type=int, default=SEED_SAMPLES, help="samples in the synthetic dataset")
    parser.add_argument("--mean-length", type=int, default=256, help="mean sample length (tokens), long-tailed")
    parser.add_argument("--max-length", type=int, default=8192, help="longest sample generated (and data.max_length)")
    parser.add_argument("--token-budget", type=int, default=16384, help="padded tokens per batch (data.token_budget)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="samples per batch cap (data.max_batch_size)")
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCAB, help="vocab size of the synthetic ids")
    parser.add_argument("--naive-subset", type=int, default=20_000, help="samples the naive preload is timed on")
    parser.add_argument("--workdir", default="/tmp/flashdraft-bench", help="where the datasets are built (reused)")
    parser.add_argument("--json", default="", help="also write the raw figures to this JSON file")


def run(args) -> int:
    workdir = Path(args.workdir)
    tag = f"n{args.samples}-mean{args.mean_length}-max{args.max_length}-v{args.vocab_size}"
    hf_dir = workdir / f"hf-{tag}"
    cache = workdir / f"cache-{tag}"
    t = time.perf_counter()
    built = make_hf_dataset(hf_dir, args.samples, args.mean_length, args.max_length, args.vocab_size)
    gen_s = time.perf_counter() - t
    print(f"[bench data] seed-form dataset {hf_dir} ({'built' if built else 'reused'} in {gen_s:.1f} s)", flush=True)

    from flashdraft.data.dataset import open_dataset

    t = time.perf_counter()
    fresh = not cache.exists()
    ds = open_dataset(hf_dir, cache_dir=cache, progress=True)
    convert_s = time.perf_counter() - t
    shard = ds.path
    print(f"[bench data] flashdraft shard {shard} ({'converted' if fresh else 'cached'} in {convert_s:.1f} s)",
          flush=True)
    del ds
    _warm_page_cache([*hf_dir.glob("*.arrow"), *shard.glob("*.bin")])

    common = dict(vocab_size=args.vocab_size, max_length=args.max_length, token_budget=args.token_budget,
                  max_batch_size=args.max_batch_size, min_supervised=32)
    python_start_s = _median([_timed_subprocess(["-c", "pass"]) for _ in range(3)])
    paths = dict(shard=str(shard), hf=str(hf_dir), cache=str(cache))
    _probe(_FLASHDRAFT_PROBE, **paths, **common)  # first run: warms caches for the imports too
    fd = _probe(_FLASHDRAFT_PROBE, **paths, **common)
    print(f"[bench data] flashdraft figures: {json.dumps(fd)}", flush=True)
    naive = _probe(_NAIVE_PROBE, **paths, subset=args.naive_subset, **common)
    print(f"[bench data] seed figures: {json.dumps(naive)}", flush=True)

    results = {"args": vars(args), "generate_s": gen_s, "convert_s": convert_s if fresh else None,
               "python_start_s": python_start_s, "flashdraft": fd, "seed": naive, "machine": machine()}
    print(format_table(results))
    if args.json:
        from flashdraft.outputs import write_report

        write_report(args.json, json.dumps(results, indent=1), flag="--json")
    return 0


def lognormal_lengths(n: int, mean: int, max_length: int, seed: int = 0) -> np.ndarray:
    """Long-tailed lengths: lognormal with sigma 1 (mean ``mean`` before clipping to [64, max_length]).

    The floor keeps every sample above the validation's min_supervised=32 (70 % is supervised).
    """
    rng = np.random.default_rng(seed)
    sigma = 1.0
    raw = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)
    return np.clip(raw.astype(np.int64), 64, max_length)


def make_hf_dataset(out: Path, n: int, mean: int, max_length: int, vocab: int, chunk: int = 50_000) -> bool:
    """Write the naive baseline's form: a `datasets` save_to_disk dir, int64 lists. False if already there.

    Built a chunk of samples at a time into one Arrow stream file, which `datasets` then
    memory-maps and saves; peak memory is one chunk, not the dataset.
    """
    if (out / "state.json").exists():
        return False
    import datasets
    import pyarrow as pa

    lengths = lognormal_lengths(n, mean, max_length)
    rng = np.random.default_rng(1)
    schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                        ("seq_len", pa.int64())])
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_name(out.name + ".raw.arrow")
    with pa.OSFile(str(raw), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for a in range(0, n, chunk):
            lens = lengths[a : a + chunk]
            offsets = np.zeros(len(lens) + 1, dtype=np.int32)
            np.cumsum(lens, out=offsets[1:])
            total = int(offsets[-1])
            ids = rng.integers(0, vocab, total, dtype=np.int64)
            # Assistant-only loss: the first ~30 % of each sample (the prompt) is unsupervised.
            pos = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1].astype(np.int64), lens)
            mask = (pos >= np.repeat((lens * 0.3).astype(np.int64), lens)).astype(np.int64)
            off = pa.array(offsets)
            writer.write_batch(pa.record_batch([
                pa.ListArray.from_arrays(off, pa.array(ids)),
                pa.ListArray.from_arrays(off, pa.array(mask)),
                pa.array(lens),
            ], schema=schema))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_file(str(raw)).save_to_disk(str(tmp))
    os.replace(tmp, out)
    raw.unlink()
    return True


def _warm_page_cache(files) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def _env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _timed_subprocess(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, env=_env())
    return time.perf_counter() - t


def _probe(code: str, **params) -> dict:
    """Run ``code`` in a fresh interpreter with PARAMS bound; it prints one JSON line last."""
    src = f"PARAMS = {params!r}\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", src], env=_env(), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"benchmark probe failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(xs):
    return float(np.median(xs))


_FLASHDRAFT_PROBE = r"""
import time
t0 = time.perf_counter()
import json
import numpy as np
import torch
from flashdraft.data.dataset import open_dataset
from flashdraft.data.batching import build_batches, padding_waste
from flashdraft.data.collate import CollateBuffers, pad_batch
t_imports = time.perf_counter() - t0

def rss_mb(field="VmRSS"):
    # /proc, not getrusage: ru_maxrss survives exec, so a child would report its parent's peak.
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

P = PARAMS
opts = dict(vocab_size=P["vocab_size"], max_length=P["max_length"], min_supervised=P["min_supervised"])
rss0 = rss_mb()
t = time.perf_counter()
ds = open_dataset(P["shard"], **opts)
t_first = time.perf_counter() - t
rss1 = rss_mb()
opens = []
for _ in range(5):
    t = time.perf_counter(); open_dataset(P["shard"], **opts); opens.append(time.perf_counter() - t)
# Training pointed at the seed-form directory: content key of the source + cache hit + open.
via = []
for _ in range(3):
    t = time.perf_counter(); open_dataset(P["hf"], cache_dir=P["cache"], **opts); via.append(time.perf_counter() - t)

plans = []
for epoch in range(3):
    t = time.perf_counter()
    plan = build_batches(ds.lengths, token_budget=P["token_budget"], max_batch_size=P["max_batch_size"], seed=0,
                         epoch=epoch)
    plans.append(time.perf_counter() - t)
waste = padding_waste(ds.lengths, plan)
rows = np.array([len(b) for b in plan])
padded = np.array([len(b) * int(ds.lengths[b].max()) for b in plan])
# Batches whose padded size is near the budget: the "16K-token batch" the acceptance names.
full = [plan[i] for i in np.flatnonzero(padded >= 0.9 * P["token_budget"])]
rng = np.random.default_rng(0)
pick = [full[i] for i in rng.choice(len(full), min(500, len(full)), replace=False)]
buffers = CollateBuffers()
for b in pick[:20]:
    pad_batch(ds, b, buffers=buffers)  # grow the buffers once
times = []
for b in pick:
    t = time.perf_counter(); pad_batch(ds, b, buffers=buffers); times.append(time.perf_counter() - t)
print(json.dumps({
    "imports_s": t_imports, "ready_first_s": t_first, "ready_median_s": float(np.median(opens)),
    "ready_via_source_s": float(np.median(via)), "rss_growth_mb": rss1 - rss0,
    "samples": len(ds), "tokens": ds.num_tokens, "dropped": ds.report.dropped, "truncated": ds.report.truncated,
    "plan_s": float(np.median(plans)), "batches": len(plan), "padding_waste": waste,
    "mean_rows": float(rows.mean()), "collate_batches": len(pick),
    "collate_rows_mean": float(np.mean([len(b) for b in pick])),
    "collate_tokens_mean": float(np.mean([len(b) * int(ds.lengths[b].max()) for b in pick])),
    "collate_median_s": float(np.median(times)), "collate_p90_s": float(np.percentile(times, 90)),
    "peak_rss_mb": rss_mb("VmHWM"), "rss_after_imports_mb": rss0,
    "end_rss_anon_mb": rss_mb("RssAnon"), "end_rss_file_mb": rss_mb("RssFile"),
}))
"""

_NAIVE_PROBE = r"""
import time
t0 = time.perf_counter()
import json
import numpy as np
import torch
import datasets
from flashdraft.data.dataset import open_dataset
from flashdraft.data.batching import build_batches
t_imports = time.perf_counter() - t0
P = PARAMS

def rss_mb(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

t = time.perf_counter()
hf = datasets.load_from_disk(P["hf"])
t_load = time.perf_counter() - t
n = len(hf)

# 1. The baseline's preload: every sample as its own tensors, one torch.tensor per sample.
k = min(P["subset"], n)
t = time.perf_counter()
sub = hf.select(range(k))
cols = sub["input_ids"], sub["loss_mask"]
pre = [(torch.tensor(i), torch.tensor(m)) for i, m in zip(*cols)]
t_pre = time.perf_counter() - t
del cols, sub

# 2. HF per-sample random access, as `[dataset[i] for i in idx]`.
rng = np.random.default_rng(0)
idx = rng.choice(n, 2000, replace=False)
t = time.perf_counter()
rows = [hf[int(i)] for i in idx]
t_access = (time.perf_counter() - t) / len(idx)
del rows

# 3. The `.tolist()`-and-Python-lists padding collate on the same 16K-token batches.
def seed_pad(samples, pad_id=0):
    ids = [s["input_ids"].tolist() for s in samples]
    mask = [s["loss_mask"].tolist() for s in samples]
    width = max(len(x) for x in ids)
    ids = [x + [pad_id] * (width - len(x)) for x in ids]
    attn = [[1] * len(x) + [0] * (width - len(x)) for x in mask]
    mask = [x + [0] * (width - len(x)) for x in mask]
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(attn)

ds = open_dataset(P["shard"], vocab_size=P["vocab_size"], max_length=P["max_length"],
                  min_supervised=P["min_supervised"])
plan = build_batches(ds.lengths, token_budget=P["token_budget"], max_batch_size=P["max_batch_size"], seed=0, epoch=0)
padded = np.array([len(b) * int(ds.lengths[b].max()) for b in plan])
full = [plan[i] for i in np.flatnonzero(padded >= 0.9 * P["token_budget"])]
pick = [full[i] for i in rng.choice(len(full), min(30, len(full)), replace=False)]
coll, acc = [], []
for b in pick:
    src = ds.source_index[b]
    t = time.perf_counter()
    rows = [hf[int(i)] for i in src]
    acc.append(time.perf_counter() - t)
    samples = [{"input_ids": torch.tensor(r["input_ids"]), "loss_mask": torch.tensor(r["loss_mask"])} for r in rows]
    t = time.perf_counter(); seed_pad(samples); coll.append(time.perf_counter() - t)
print(json.dumps({
    "imports_s": t_imports, "load_from_disk_s": t_load, "preload_subset": k, "preload_subset_s": t_pre,
    "preload_extrapolated_s": t_pre * n / k, "access_per_sample_s": t_access,
    "access_per_batch_median_s": float(np.median(acc)), "collate_median_s": float(np.median(coll)),
    "collate_batches": len(pick), "peak_rss_mb": rss_mb("VmHWM"),
    "end_rss_anon_mb": rss_mb("RssAnon"), "end_rss_file_mb": rss_mb("RssFile"),
}))
"""


def machine() -> str:
    import platform

    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"Python {platform.python_version()}, numpy {np.__version__}")


def format_table(r: dict) -> str:
    a, fd, sd = r["args"], r["flashdraft"], r["seed"]
    naive_ready = sd["load_from_disk_s"] + sd["preload_extrapolated_s"]
    naive_batch = sd["access_per_batch_median_s"] + sd["collate_median_s"]

    def ms(x):
        return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"

    rows = [
        ("Time to ready (open + validate), warm page cache, after imports",
         f"{ms(naive_ready)} (load_from_disk {ms(sd['load_from_disk_s'])} + per-sample torch.tensor preload "
         f"{ms(sd['preload_extrapolated_s'])}, extrapolated from {sd['preload_subset']:,} samples)",
         f"{ms(fd['ready_first_s'])} (first open in the process; re-opens {ms(fd['ready_median_s'])})",
         f"{naive_ready / fd['ready_first_s']:,.0f}x"),
        ("Time to ready given the seed-form directory (content key + cache hit + open)", "as above",
         ms(fd["ready_via_source_s"]), f"{naive_ready / fd['ready_via_source_s']:,.0f}x"),
        ("Random access per sample", f"{ms(sd['access_per_sample_s'])} (`dataset[i]`)",
         "in the gather below", ""),
        (f"Batch of ~{fd['collate_tokens_mean']:,.0f} padded tokens ({fd['collate_rows_mean']:.1f} rows): fetch + pad",
         f"{ms(naive_batch)} ({ms(sd['access_per_batch_median_s'])} `dataset[i]` + {ms(sd['collate_median_s'])} "
         f"`.tolist()` pad)", f"{ms(fd['collate_median_s'])} median, {ms(fd['collate_p90_s'])} p90 (pad_batch)",
         f"{naive_batch / fd['collate_median_s']:,.0f}x"),
        ("`.tolist()` pad alone vs pad_batch", ms(sd["collate_median_s"]), ms(fd["collate_median_s"]),
         f"{sd['collate_median_s'] / fd['collate_median_s']:,.0f}x"),
        (f"Batch plan, all {fd['samples']:,} samples", "(none)",
         f"{ms(fd['plan_s'])} ({fd['batches']:,} batches, padding waste {fd['padding_waste']:.2%})", ""),
        ("RSS growth from opening (after imports)", "", f"{fd['rss_growth_mb']:.1f} MB", ""),
        ("Peak RSS of the process (VmHWM)", f"{sd['peak_rss_mb']:,.0f} MB (preload of {sd['preload_subset']:,} "
         f"samples only, + the HF batches)",
         f"{fd['peak_rss_mb']:,.0f} MB (open + plan + {fd['collate_batches']} batches)", ""),
        ("RSS at the end: anonymous / file-backed",
         f"{sd['end_rss_anon_mb']:,.0f} MB / {sd['end_rss_file_mb']:,.0f} MB",
         f"{fd['end_rss_anon_mb']:,.0f} MB / {fd['end_rss_file_mb']:,.0f} MB (file-backed = page-cache pages of the "
         "memory map touched by gathers, shared and reclaimable)", ""),
        ("Imports / interpreter start", f"{ms(sd['imports_s'])} / {ms(r['python_start_s'])}",
         f"{ms(fd['imports_s'])} / {ms(r['python_start_s'])}", ""),
    ]
    head = (f"Synthetic data: {fd['samples']:,} samples, {fd['tokens']:,} tokens "
            f"(mean {fd['tokens'] / fd['samples']:.0f}, lognormal, max {a['max_length']}), vocab {a['vocab_size']:,}; "
            f"budget {a['token_budget']:,} tokens, max batch {a['max_batch_size']}. Machine: {r['machine']}.")
    if r.get("convert_s") is not None:
        head += f" One-time conversion of the seed-form dataset: {r['convert_s']:.1f} s."
    lines = [head, "", "| Measure | Seed data path | flashdraft | Ratio |", "|---|---|---|---|"]
    lines += [f"| {m} | {s} | {f} | {x} |" for m, s, f, x in rows]
    return "\n".join(lines)
