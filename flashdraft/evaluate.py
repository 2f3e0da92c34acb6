"""Evaluation: real draft/verify tau over prompts, losslessness, and the `flashdraft eval` command."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from flashdraft import distributed
from flashdraft.config import DTYPES
from flashdraft.drafter import DFlashDrafter, serving
from flashdraft.outputs import check_report, write_report
from flashdraft.speculative import (
    GREEDY,
    Generation,
    Sampling,
    greedy_generate,
    ngram_generate,
    speculative_generate,
    target_generate,
    tau_per_prompt,
    tau_pooled,
)
from flashdraft.target import TargetModel


def read_prompts(path: str | os.PathLike) -> list[list[int]]:
    """A JSONL file of {"input_ids": [...]} lines -> token-id prompts (errors name the line)."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:  # a directory, binary bytes: named, not a bare OS error
        raise ValueError(f"{path}: cannot read the prompts ({exc.strerror if isinstance(exc, OSError) else exc}); "
                         'give a UTF-8 JSONL file, one {"input_ids": [...]} per line') from None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["input_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{line_no}: expected a JSON object with an input_ids list ({exc})") from None
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):  # true is no token id
            raise ValueError(f"{path}:{line_no}: input_ids must be a non-empty list of token ids")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def check_prompts_fit(prompts: list[list[int]], target_config, path, *, max_new_tokens: int = 0,
                      block_size: int = 0) -> None:
    """Every prompt id must index the target's embedding table (else a bare IndexError mid-eval),
    and a prompt, its ``max_new_tokens`` and one verification block (``block_size``) must fit the
    target's positions (else garbage past max_position_embeddings, or an error deep in decoding)."""
    vocab_size = int(target_config.vocab_size)
    max_pos = getattr(target_config, "max_position_embeddings", None)
    for line_no, ids in enumerate(prompts, 1):
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"{path}: prompt {line_no} has token id "
                             f"{max(ids) if max(ids) >= vocab_size else min(ids)} outside the target's vocabulary "
                             f"[0, {vocab_size}): were the prompts tokenized with this target's tokenizer?")
        if max_pos and len(ids) + max_new_tokens + block_size > max_pos:
            need = len(ids) + max_new_tokens + block_size
            raise ValueError(f"{path}: prompt {line_no} has {len(ids)} tokens; with {max_new_tokens} new tokens and a "
                             f"block of {block_size} it needs {need} positions, more than the target's "
                             f"max_position_embeddings={max_pos}: shorten it or generate fewer tokens")


def check_drafter_fits(drafter: DFlashDrafter, target: TargetModel, drafter_dir, target_dir) -> None:
    """A drafter trained for another target fails with a clear message, not a shape error."""
    cfg = drafter.config
    wanted = {"hidden_size": target.hidden_size, "num_target_layers": target.num_layers,
              "vocab_size": target.embed.num_embeddings}
    diffs = [f"{k} {cfg.get(k)} vs {v}" for k, v in wanted.items() if cfg.get(k) is not None and cfg.get(k) != v]
    if diffs:
        raise ValueError(f"{drafter_dir} was trained for another target than {target_dir} ({', '.join(diffs)}: "
                         "drafter vs target); evaluate it with the target it was trained on")


def write_prompts(path: str | os.PathLike, prompts: list[list[int]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for ids in prompts:
            f.write(json.dumps({"input_ids": [int(t) for t in ids]}) + "\n")


def prompts_from_dataset(dataset, count: int) -> list[list[int]]:
    """Prompts of the first ``count`` samples: their tokens before the first supervised one."""
    prompts = []
    for i in range(len(dataset)):
        ids, mask = dataset[i]
        first = int(np.argmax(mask != 0)) if mask.any() else 0
        if first > 0:
            prompts.append(np.asarray(ids[:first]).tolist())
        if len(prompts) == count:
            break
    return prompts


def _per_position_acceptance(accepted: list[int], block_size: int) -> list[float]:
    """P(draft k accepted) for k = 1 .. bs-1, pooled over all steps of all prompts (as the engines
    report it)."""
    steps = np.asarray(accepted)
    if steps.size == 0:
        return [float("nan")] * (block_size - 1)
    return [float((steps >= k).mean()) for k in range(1, block_size)]


@torch.no_grad()
def evaluate_tau(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids=(),
    baseline: str | None = None,
    check_lossless: bool = True,
    block_size: int | None = None,
    references: list[Generation] | None = None,
    sampling: Sampling = GREEDY,
) -> dict:
    """Speculative decoding over ``prompts``. Two taus (docs/evaluation.md): ``tau``, the mean
    over prompts of each prompt's mean (the papers'), and ``tau_pooled``, every step pooled (what
    vLLM and SGLang report); the per-position acceptance is pooled.

    ``baseline="ngram"`` drafts by prompt lookup instead of the drafter. ``sampling`` is the
    target's sampling (greedy by default; prompt i is decoded with seed ``sampling.seed + i``).
    With ``check_lossless``, greedy: every output is compared with the target's plain greedy
    output, and the greedy wall-clock is the speedup's denominator; ``references`` (the
    ``greedy_generate`` outputs of the same prompts and settings) spares re-running greedy for
    each drafter compared. Sampled, the outputs are random, so there is nothing to compare
    token for token (that the sampler keeps the target's distribution is what the tests show):
    the plain sampled decoding of each prompt is timed for the speedup.
    """
    if references is not None and len(references) != len(prompts):
        raise ValueError(f"got {len(references)} greedy references for {len(prompts)} prompts")
    if references is not None and not sampling.greedy:
        raise ValueError("greedy references cannot check sampled outputs")
    bs = block_size or drafter.block_size
    per_prompt, lossless, spec_s, plain_s, new_tokens = [], True, 0.0, 0.0, 0
    for i, prompt in enumerate(prompts):
        each = sampling if sampling.greedy else dataclasses.replace(sampling, seed=sampling.seed + i)
        if baseline == "ngram":
            gen = ngram_generate(target, prompt, max_new_tokens, bs, eos_ids, sampling=each)
        else:
            gen = speculative_generate(target, drafter, prompt, max_new_tokens, eos_ids, sampling=each)
        per_prompt.append(gen.accepted)
        spec_s += gen.seconds
        new_tokens += len(gen.tokens)
        if check_lossless and sampling.greedy:
            ref = references[i] if references is not None else greedy_generate(target, prompt, max_new_tokens, eos_ids)
            plain_s += ref.seconds
            lossless &= ref.tokens == gen.tokens
        elif check_lossless:
            plain_s += target_generate(target, prompt, max_new_tokens, eos_ids, each).seconds
    report = {
        "tau": tau_per_prompt(per_prompt),
        "tau_pooled": tau_pooled(per_prompt),
        "per_position_acceptance": _per_position_acceptance([a for steps in per_prompt for a in steps], bs),
        "steps": sum(len(steps) for steps in per_prompt),
        "num_prompts": len(prompts),
        "new_tokens": new_tokens,
        "speculative_seconds": spec_s,
        "settings": {"max_new_tokens": max_new_tokens, "block_size": bs, "greedy": sampling.greedy,
                     "drafter": "ngram" if baseline == "ngram" else "dflash2" if drafter.convolved else "dflash",
                     **({} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                    "top_k": sampling.top_k, "seed": sampling.seed})},
    }
    if check_lossless:
        speedup = plain_s / spec_s if spec_s > 0 else float("nan")
        if sampling.greedy:
            report.update(lossless=bool(lossless), greedy_seconds=plain_s, speedup=speedup)
        else:
            report.update(sampled_seconds=plain_s, speedup=speedup)
    return report


def _strict(value):
    """``value`` with every non-finite float as None (null): a tau or acceptance that was never
    measured (every prompt ended at once) is unknown, and JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return None if isinstance(value, float) and not np.isfinite(value) else value


def eos_ids_of(target_dir: str | os.PathLike, config) -> list[int]:
    """End-of-sequence ids from generation_config.json / config.json (empty if none)."""
    ids = []
    gen_cfg = Path(target_dir) / "generation_config.json"
    if gen_cfg.is_file():
        ids = json.loads(gen_cfg.read_text()).get("eos_token_id") or []
    if not ids:
        ids = getattr(config, "eos_token_id", None) or []
    return [ids] if isinstance(ids, int) else list(ids)


# ---- `flashdraft eval` -------------------------------------------------------------------


def _at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (a bad value is a one-line usage error at parse)."""
    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: use {minimum} or more")
        return value
    return parse


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="Hugging Face target model directory")
    parser.add_argument("--drafter", help="DFlash drafter directory (serving format); not needed with --baseline")
    parser.add_argument("--prompts", required=True, help='JSONL, one {"input_ids": [...]} per line')
    parser.add_argument("--max-new-tokens", type=_at_least(1), default=128, help="tokens generated per prompt")
    parser.add_argument("--baseline", choices=["ngram"], help="evaluate a no-model baseline instead of the drafter")
    parser.add_argument("--block-size", type=_at_least(2),
                        help="block size for --baseline (default 16); with --drafter only the drafter's own (the one "
                             "it decodes with) is accepted")
    parser.add_argument("--no-eos", action="store_true", help="ignore end-of-sequence tokens (fixed-length outputs)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the target's sampling temperature (0: greedy, checked token for token against plain "
                             "greedy decoding; > 0: drafts sampled and verified by rejection sampling)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the target's nucleus (1: off); with --temperature")
    parser.add_argument("--top-k", type=int, default=0, help="the target's top-k (0: off); with --temperature")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32")
    parser.add_argument("--output", help="write the JSON report here")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="shard the target over this many ranks (launch that many with torchrun; rank 0 reports)")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tensor-parallel: split a MoE target's experts over the ranks instead")
    parser.add_argument("--engine", choices=["vllm"],
                        help="also decode the prompts with the drafter in this serving engine and report its counters "
                             "next to flashdraft's own decode of the same prompts (docs/evaluation.md; CPU: vLLM's "
                             "CPU build in an environment created and cached on first use)")
    parser.add_argument("--engine-python", metavar="PATH",
                        help="with --engine: the python of an environment where vLLM is installed (a GPU machine's "
                             "serving environment; default: $FLASHDRAFT_ENGINE_PYTHON, else flashdraft's CPU build); "
                             "flashdraft installs nothing there")


def _check_device(device: str) -> None:
    """``--device`` as torch names it, present here: a bad name or an absent accelerator is one line."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch sees no CUDA device; use --device cpu")


def run(args) -> int:
    if args.drafter is None and args.baseline is None:
        print("flashdraft eval: give --drafter DIR (or --baseline ngram)", file=sys.stderr)
        return 2
    if args.drafter is not None and args.baseline is not None:
        raise ValueError("--drafter and --baseline: evaluate one of them (the report would name only one)")
    _check_device(args.device)
    if args.dtype not in DTYPES:
        print(f"flashdraft eval: --dtype {args.dtype!r}: use one of {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    if args.temperature == 0 and (args.top_p != 1 or args.top_k != 0):
        raise ValueError("--top-p / --top-k shape sampling: give a --temperature above 0 with them")
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed)  # a bad value: one line
    drafter = None
    layer_ids, block_size = [0], args.block_size or 16  # the n-gram baseline reads no taps
    if args.drafter:  # a directory that is no drafter export (e.g. the target's) is refused here
        cfg = serving.read_config(args.drafter)
        layer_ids = cfg["dflash_config"]["target_layer_ids"]
        block_size = int(cfg["dflash_config"].get("block_size") or cfg["block_size"])
        if args.block_size not in (None, block_size):  # the drafter decodes with its own: the report would lie
            raise ValueError(f"--block-size {args.block_size}: {args.drafter} drafts blocks of {block_size}, the "
                             "size it decodes and is reported with; drop --block-size (it sets --baseline's)")
    prompts = read_prompts(args.prompts)  # before loading models: a bad file fails in seconds
    if args.output:  # found now, not after the whole evaluation; never one of its own inputs (flashdraft.outputs)
        check_report(args.output, flag="--output", inputs=[args.prompts], model_dirs=[args.target, args.drafter])
    if args.engine_python and not args.engine:
        raise ValueError("--engine-python names the interpreter --engine runs vLLM with: add --engine vllm, or drop it")
    if args.engine:  # found before minutes of decoding, not after
        from flashdraft.vllm_env import why_unavailable

        reason = why_unavailable(args.engine_python)
        if args.drafter is None or args.baseline or args.tensor_parallel > 1:
            raise ValueError("--engine: give --drafter DIR, with one process (no --baseline / --tensor-parallel)")
        if reason:
            raise ValueError(f"--engine {args.engine}: cannot run here: {reason}")
        if not sampling.greedy:
            from flashdraft.judge.engine import SAMPLED_UNVERIFIED

            raise ValueError(f"--engine {args.engine} with --temperature {args.temperature:g}: the engine check is "
                             f"greedy only ({SAMPLED_UNVERIFIED}); drop --temperature / --top-p / --top-k for it, "
                             "or evaluate sampling without --engine")
    if args.tensor_parallel < 1 or (args.expert_parallel and args.tensor_parallel == 1):
        raise ValueError("--tensor-parallel: use 1 or more ranks (and more than 1 with --expert-parallel)")
    main = True
    if args.tensor_parallel > 1 and os.environ.get("WORLD_SIZE", "1") != str(args.tensor_parallel):
        raise ValueError(f"--tensor-parallel {args.tensor_parallel} on WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')}"
                         f": launch exactly that many ranks (torchrun --nproc-per-node={args.tensor_parallel} -m "
                         "flashdraft.cli eval ...), or drop --tensor-parallel")
    if args.tensor_parallel > 1:  # every rank runs the same decoding in lockstep; rank 0 reports
        dist = distributed.init_distributed(args.device, tensor_parallel=args.tensor_parallel)
        if dist.world_size != args.tensor_parallel:
            raise ValueError(f"--tensor-parallel {args.tensor_parallel} on WORLD_SIZE={dist.world_size}: launch "
                             f"exactly that many ranks (torchrun --nproc-per-node={args.tensor_parallel})")
        main = dist.rank == 0
    target = TargetModel.from_pretrained(args.target, target_layer_ids=layer_ids, device=args.device, dtype=args.dtype,
                                         tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel)
    check_prompts_fit(prompts, target.config, args.prompts, max_new_tokens=args.max_new_tokens, block_size=block_size)
    if args.drafter:
        drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=target.dtype, device=args.device).eval()
        check_drafter_fits(drafter, target, args.drafter, args.target)
    eos = [] if args.no_eos else eos_ids_of(args.target, target.config)
    report = evaluate_tau(target, drafter, prompts, max_new_tokens=args.max_new_tokens, eos_ids=eos,
                          baseline=args.baseline, block_size=block_size, sampling=sampling)
    if args.tensor_parallel > 1:
        local, whole = target.weight_bytes()
        report["target_sharding"] = {"ranks": args.tensor_parallel, "expert_parallel": args.expert_parallel,
                                     "weight_bytes_per_rank": local, "weight_bytes_unsharded": whole}
        distributed.teardown()
    if not main:
        return 0 if report.get("lossless", True) else 1
    agrees = True
    if args.engine:
        del target, drafter  # the check loads both in fp32 (the engine decodes in fp32 too)
        agrees = _engine_check(report, args, prompts, eos, sampling)
    _write_report(report, args.output)
    return 0 if report.get("lossless", True) and agrees else 1


def _engine_check(report: dict, args, prompts, eos, sampling: Sampling) -> bool:
    """The same prompts through the serving engine (``report["engine"]``); whether it agrees."""
    from flashdraft.judge.engine import engine_check, format_check
    from flashdraft.vllm_env import EngineUnavailable

    try:
        report["engine"] = engine_check(args.target, args.drafter, prompts, max_new_tokens=args.max_new_tokens,
                                        eos_ids=eos, sampling=sampling, device=args.device, python=args.engine_python,
                                        log=lambda m: print(m, file=sys.stderr))
    except EngineUnavailable as exc:  # keep the minutes of flashdraft's own decode in the report
        report["engine"] = {"engine_error": str(exc)}
    print(format_check(report["engine"]), file=sys.stderr)
    return report["engine"].get("lossless", True) is not False and report["engine"].get("tau_agrees", False)


def _write_report(report: dict, output: str | None) -> None:
    """Print the report (strict JSON: a bare NaN is no JSON) and write it to ``output``."""
    text = json.dumps(_strict(report), indent=2, allow_nan=False)
    print(text)
    if output:
        try:  # checked at the start; a disk filled since (or /dev/full) fails only now
            write_report(output, text + "\n", flag="--output")
        except ValueError as exc:
            raise ValueError(f"{exc}; it is printed above on stdout") from None
