"""`flashdraft prepare`: conversations -> chat template -> (input_ids, loss_mask) -> one token shard.

Worker processes (all cores by default) decode, normalise and tokenize chunks of records; the
main process appends their results to a ``TokenShardWriter`` in input order, so the shard is
deterministic whatever the worker count. Bad records never stop the run: each is skipped and
counted by reason (the first few messages, naming file and line, are kept in the summary).

The output is cache-keyed: ``meta.json``'s ``source`` holds ``cache_key`` = sha256 of (input
file contents, tokenizer vocabulary + chat template + special tokens, max_length,
min_supervised, thinking options, prepare version). A rerun with the same key returns the
stored summary at once; any change (a new template included) rebuilds the shard.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from flashdraft.checkpoint import sha256_file
from flashdraft.data.chat import SampleError, normalize_record
from flashdraft.data.masking import probe_template, tokenize_conversation
from flashdraft.data.shards import META, TokenShardWriter, is_token_shard
from flashdraft.data.sources import decode_record, iter_records, source_files

PREPARE_VERSION = 2  # bump when the produced tokens/masks change for identical inputs (2: real templates, tools)
CHUNK = 64  # records per worker task: amortises inter-process overhead
MAX_ERRORS_KEPT = 20


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if path.is_file() or (not path.exists() and (path.is_absolute() or str(tokenizer_dir).startswith("."))):
        raise ValueError(f"--tokenizer {tokenizer_dir}: {'a file' if path.is_file() else 'no such directory'}; give "
                         "the target model's directory (its tokenizer files and chat template)")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{tokenizer_dir}: a fast (tokenizers-backed) tokenizer is required for offset mapping")
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything that decides how text becomes tokens: vocab, merges, added and
    special tokens, normaliser/pre-tokeniser, and the chat template."""
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    template = tokenizer.chat_template
    h.update(json.dumps(template, sort_keys=True).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map alone: what the ids of a prepared shard mean. Stored in the
    shard (source.vocab_sha256); training checks it against the target's tokenizer."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def cache_key(inputs, tokenizer, options: dict) -> str:
    """The prepared data's identity: sources' content, tokenizer + template, and options."""
    payload = {
        "version": PREPARE_VERSION,
        "sources": [sha256_file(p) for p in source_files(inputs)],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": options,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# ---- worker side -------------------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, options: dict) -> None:
    # A forked worker inherits the parent's Python signal handlers (a benchmark's SIGTERM ->
    # Stopped, which a record's `except Exception` would swallow, leaving the pool's terminate()
    # waiting on a worker that never exits). Stopping is the parent's business: SIGTERM ends a
    # worker at once, and the terminal's Ctrl-C, which reaches every process of the group, is
    # left to the parent (which terminates the pool).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _load_state(tokenizer_dir, options)


def _load_state(tokenizer_dir, options: dict) -> None:
    """This process's tokenizer, options and template probe, for ``_tokens`` (prepare has
    refused a tokenizer without a chat template before any record)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    _STATE.clear()
    _STATE.update(tokenizer=tokenizer, options=options, info=probe_template(tokenizer, options["enable_thinking"]))


def _tokens(where: str, payload: Any) -> tuple[np.ndarray, np.ndarray]:
    """One record -> its whole (untruncated) ids and loss mask. Raises ``SampleError``."""
    opts, tokenizer, info = _STATE["options"], _STATE["tokenizer"], _STATE["info"]
    record = normalize_record(decode_record(where, payload), where)
    return tokenize_conversation(tokenizer, record.get("messages"), tools=record.get("tools"), text=record.get("text"),
                                 supervise_thinking=opts["supervise_thinking"], info=info, where=where)


def process_record(where: str, payload: Any) -> tuple:
    """One record -> ("ok", ids uint32, mask uint8, truncated) or ("drop", reason, message)."""
    opts = _STATE["options"]
    try:
        ids, mask = _tokens(where, payload)
    except SampleError as exc:
        return ("drop", exc.reason, str(exc))
    except Exception as exc:  # a template error on one odd record must not end the run
        return ("drop", "error", f"{where}: {type(exc).__name__}: {exc}")
    truncated = len(ids) > opts["max_length"]
    ids, mask = ids[:opts["max_length"]], mask[:opts["max_length"]]
    supervised = int(mask.sum())
    if supervised < opts["min_supervised"]:
        return ("drop", "too_few_supervised",
                f"{where}: {supervised} supervised tokens < min_supervised {opts['min_supervised']}")
    return ("ok", ids.astype(np.uint32), mask, truncated)


def _process_chunk(chunk: list) -> list:
    return [process_record(where, payload) for where, payload in chunk]


# ---- main side ---------------------------------------------------------------------------
def _chunks(records, size: int):
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _results(chunks, tokenizer_dir: str, options: dict, num_workers: int):
    """Yield per-record results in input order; at most a few chunks per worker in flight."""
    if num_workers <= 1:
        _load_state(tokenizer_dir, options)
        for chunk in chunks:
            yield from _process_chunk(chunk)
        return
    # fork: workers start in milliseconds and inherit imported modules; each loads its own
    # tokenizer in the initializer (nothing Rust-side is shared across the fork).
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(num_workers, initializer=_init_worker, initargs=(tokenizer_dir, options)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_process_chunk, (chunk,)))
            while len(pending) >= 4 * num_workers:  # bounded: memory stays flat on any input size
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
        pool.close()  # a finished run lets its workers exit; the `with` terminates them only on an error
        pool.join()


def prepare(inputs, tokenizer_dir, out_dir, *, max_length: int = 3072, min_supervised: int = 32,
            num_workers: int | None = None, supervise_thinking: bool = True, enable_thinking: bool | None = None,
            split: str | None = None, force: bool = False, progress: bool = True, log=print) -> dict:
    """Tokenize conversations into a token shard at ``out_dir``; returns the summary dict.

    ``inputs``: JSONL / JSON / parquet files, directories of them, globs, or Hugging Face
    ``save_to_disk`` directories (``split`` picks a DatasetDict split). ``tokenizer_dir``: the
    target's tokenizer (its chat template is applied). Samples are truncated to
    ``max_length`` tokens; those with fewer than ``min_supervised`` supervised tokens are
    dropped (DFlash: 2 * block_size). ``enable_thinking`` must match how the target is served
    (None: the template's default); ``supervise_thinking`` decides whether ``<think>`` blocks
    get loss. ``num_workers`` defaults to all cores. If ``out_dir`` already holds a shard with
    the same cache key, nothing is recomputed (``summary["cached"]`` is True) unless ``force``.

    Summary keys: samples_in, samples, tokens, supervised_tokens, supervised_share, truncated,
    dropped {reason: count}, errors [first messages], seconds, samples_per_s, num_workers,
    cache_key, cached, out_dir.
    """
    t0 = time.perf_counter()
    inputs = [str(i) for i in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)]
    out_dir = Path(out_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    if not tokenizer.chat_template:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no chat_template; prepare needs the target's template")
    options = {"max_length": int(max_length), "min_supervised": int(min_supervised),
               "supervise_thinking": bool(supervise_thinking), "enable_thinking": enable_thinking, "split": split}
    probe_template(tokenizer, enable_thinking)  # fail fast, in the main process, on an unusable template
    key = cache_key(inputs, tokenizer, options)
    if not force and is_token_shard(out_dir):
        source = json.loads((out_dir / META).read_text()).get("source", {})
        if source.get("cache_key") == key:
            summary = dict(source["summary"], cached=True, seconds=time.perf_counter() - t0)
            log(f"prepare: {out_dir} is up to date (cache key {key[:12]}), nothing to do")
            return summary
        log(f"prepare: {out_dir} was prepared from other inputs / tokenizer / template / options; rebuilding")
    num_workers = max(1, int(num_workers or os.cpu_count() or 1))

    counts = collections.Counter()
    dropped = collections.Counter()
    errors: list[str] = []
    examples: dict[str, str] = {}
    from tqdm import tqdm

    bar = tqdm(desc="prepare", unit=" samples", disable=not progress, mininterval=0.5, smoothing=0.1)
    source = {"tool": "flashdraft prepare", "cache_key": key, "inputs": inputs, "tokenizer": str(tokenizer_dir),
              "vocab_sha256": vocab_fingerprint(tokenizer), "options": options}
    with TokenShardWriter(out_dir, vocab_size=len(tokenizer), source=source) as writer:
        chunks = _chunks(iter_records(inputs, split), CHUNK)
        for result in _results(chunks, str(tokenizer_dir), options, num_workers):
            counts["samples_in"] += 1
            if result[0] == "ok":
                _, ids, mask, truncated = result
                writer.add(ids, mask)
                counts["samples"] += 1
                counts["tokens"] += len(ids)
                counts["supervised_tokens"] += int(mask.sum())
                counts["truncated"] += int(truncated)
            else:
                dropped[result[1]] += 1
                examples.setdefault(result[1], result[2])  # every reason is shown with its first case
                # Filtered-out short samples are expected; keep the messages of real input problems.
                if len(errors) < MAX_ERRORS_KEPT and result[1] != "too_few_supervised":
                    errors.append(result[2])
            bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        summary = {
            "samples_in": counts["samples_in"], "samples": counts["samples"], "tokens": counts["tokens"],
            "supervised_tokens": counts["supervised_tokens"],
            "supervised_share": counts["supervised_tokens"] / max(1, counts["tokens"]),
            "truncated": counts["truncated"], "dropped": dict(sorted(dropped.items())), "errors": errors,
            "examples": dict(sorted(examples.items())),
            "seconds": seconds, "samples_per_s": counts["samples_in"] / max(seconds, 1e-9),
            "num_workers": num_workers, "cache_key": key, "cached": False, "out_dir": str(out_dir),
        }
        writer.source["summary"] = summary  # stored in meta.json when the writer closes
    log(format_summary(summary))
    return summary


def format_summary(s: dict) -> str:
    lines = [
        f"prepare: {s['samples']:,} of {s['samples_in']:,} samples -> {s['out_dir']}",
        f"  tokens {s['tokens']:,}, supervised {s['supervised_tokens']:,} ({100 * s['supervised_share']:.1f} %), "
        f"truncated {s['truncated']:,}",
        f"  {s['seconds']:.1f} s, {s['samples_per_s']:,.0f} samples/s on {s['num_workers']} workers",
    ]
    if s["dropped"]:
        lines.append("  dropped (what each reason means: docs/prepare.md):")
        examples = s.get("examples", {})
        lines += [f"    {reason} {n:,}" + (f" -- e.g. {examples[reason]}" if reason in examples else "")
                  for reason, n in s["dropped"].items()]
        lines.append(f"    ({len(s['errors'])} messages kept in meta.json source.summary.errors)")
    return "\n".join(lines)


# ---- explain -----------------------------------------------------------------------------
SUPERVISED_OPEN, SUPERVISED_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: never in a chat template's markup


def explain(inputs, tokenizer_dir, index: int, *, max_length: int = 3072, min_supervised: int = 32,
            supervise_thinking: bool = True, enable_thinking: bool | None = None, split: str | None = None) -> str:
    """Record ``index`` (0-based, in prepare's input order) as prepare tokenizes it: the rendered
    text with every supervised run between ⟦ and ⟧, where --max-length cuts it, and whether the
    sample is kept (or why not)."""
    inputs = [str(i) for i in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)]
    options = {"max_length": int(max_length), "min_supervised": int(min_supervised),
               "supervise_thinking": bool(supervise_thinking), "enable_thinking": enable_thinking, "split": split}
    _load_state(tokenizer_dir, options)
    tokenizer = _STATE["tokenizer"]
    # an index beyond sys.maxsize (islice's limit) is beyond every input too
    found = next(itertools.islice(iter_records(inputs, split), index, None), None) \
        if 0 <= index <= sys.maxsize else None
    if found is None:
        raise ValueError(f"--explain {index}: the inputs hold {sum(1 for _ in iter_records(inputs, split))} "
                         "records, numbered from 0")
    where, payload = found
    dropped = process_record(where, payload)  # what a full prepare does with it, error included
    if dropped[0] == "drop" and dropped[1] != "too_few_supervised":
        return f"{where} (record {index}) is dropped: {dropped[1]}: {dropped[2]}"
    ids, mask = _tokens(where, payload)
    pieces, k = [], 0
    while k < len(ids):  # runs of equal mask, decoded as the target reads them
        j = k
        while j < len(ids) and mask[j] == mask[k] and not (k < max_length <= j):
            j += 1
        if k == max_length:
            pieces.append(f"\n\u2702 --max-length {max_length} cuts here: the {len(ids) - max_length} tokens "
                          "below are not trained on\n")
        text = tokenizer.decode(ids[k:j].tolist())
        pieces.append(SUPERVISED_OPEN + text + SUPERVISED_CLOSE if mask[k] else text)
        k = j
    kept = mask[:max_length]
    supervised, runs = int(kept.sum()), int(np.count_nonzero(np.diff(np.concatenate([[0], kept])) == 1))
    verdict = "kept" if supervised >= min_supervised else \
        f"dropped: too_few_supervised (fewer than --min-supervised {min_supervised})"
    return (f"{where} (record {index}): {min(len(ids), max_length)} tokens, {supervised} supervised in {runs} "
            f"run(s) between {SUPERVISED_OPEN} and {SUPERVISED_CLOSE}; {verdict}\n\n" + "".join(pieces))


# ---- CLI ---------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="+", help="JSONL/JSON/parquet files, dirs, globs or HF dataset dirs")
    parser.add_argument("--tokenizer", required=True, help="the target's tokenizer dir (its chat template is used)")
    parser.add_argument("--out", help="output token shard directory (required unless --explain)")
    parser.add_argument("--max-length", type=int, default=3072, help="truncate samples to this many tokens")
    parser.add_argument("--block-size", type=int, default=16, help="drafter block size (min supervised = 2x this)")
    parser.add_argument("--min-supervised", type=int, default=None,
                        help="drop samples with fewer supervised tokens (default: 2 * block size)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    parser.add_argument("--thinking", choices=["default", "on", "off"], default="default",
                        help="the target's serving mode, passed to the template as enable_thinking")
    parser.add_argument("--no-supervise-thinking", dest="supervise_thinking", action="store_false",
                        help="give <think>...</think> blocks no loss (default: supervised)")
    parser.add_argument("--split", default=None, help="split of a HF DatasetDict (default: train)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache key matches")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--explain", type=int, default=None, metavar="N",
                        help="show record N (from 0) as it would be trained on: the rendered text with the "
                             "supervised tokens between ⟦ ⟧; writes nothing")


def thinking_flag(value: str) -> bool | None:
    return {"default": None, "on": True, "off": False}[value]


def run(args) -> int:
    for flag, value, least in (("--max-length", args.max_length, 1), ("--block-size", args.block_size, 2),
                               ("--min-supervised", args.min_supervised, 0), ("--workers", args.workers, 0)):
        if value is not None and value < least:  # before any record is read: a bad count is one line
            raise ValueError(f"{flag} {value}: use {least} or more")
    min_supervised = args.min_supervised if args.min_supervised is not None else 2 * args.block_size
    if args.explain is not None:
        print(explain(args.inputs, args.tokenizer, args.explain, max_length=args.max_length,
                      min_supervised=min_supervised, supervise_thinking=args.supervise_thinking,
                      enable_thinking=thinking_flag(args.thinking), split=args.split))
        return 0
    if args.out is None:
        raise ValueError("give --out DIR (where the token shard is written), or --explain N to look at one record")
    from flashdraft.data.shards import is_token_shard
    from flashdraft.outputs import check_output

    check_output(args.out, flag="--out", inputs=[*args.inputs, args.tokenizer], kind="a token shard",
                 is_kind=is_token_shard)  # the paths a command may write (flashdraft.outputs)
    summary = prepare(args.inputs, args.tokenizer, args.out, max_length=args.max_length, min_supervised=min_supervised,
                      num_workers=args.workers, supervise_thinking=args.supervise_thinking,
                      enable_thinking=thinking_flag(args.thinking), split=args.split, force=args.force,
                      progress=args.progress)
    if summary["samples"] == 0:
        hint = (f"every sample had fewer than {min_supervised} supervised tokens within --max-length "
                f"{args.max_length}: raise --max-length or lower --min-supervised"
                if set(summary["dropped"]) == {"too_few_supervised"} else "see the dropped reasons above")
        print(f"flashdraft prepare: error: no usable sample in {', '.join(map(str, args.inputs))}; {hint}",
              file=sys.stderr)
        return 1
    return 0
