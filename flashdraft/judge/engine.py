"""The serving engine as the judge: an export decoded by vLLM itself, next to flashdraft's decode.

flashdraft never imports vLLM: ``workers/engine_worker.py`` runs with the engine environment's
interpreter (flashdraft.vllm_env: the one the user names, else flashdraft's cached CPU build),
a request and a result file as JSON in between (protocol.run_worker).

``engine_check`` decodes the same prompts both ways and compares (docs/evaluation.md):
- greedy: vLLM's speculative output token for token against vLLM's own plain greedy (lossless),
  and against flashdraft's;
- each prompt's per-step acceptance, counted as vLLM's scheduler counts it (the last step's
  drafts accepted past eos / the token limit included: ``Generation.engine_accepted``), step
  for step: the same drafts were proposed at every step when they agree;
- both taus of each side; the pooled taus must agree within ``tolerance``, else the report says
  so (``tau_agrees`` false).
"""

from __future__ import annotations

import os
from pathlib import Path

from flashdraft.judge.protocol import WORKERS, agreement, agreement_lines, run_worker, side, side_line
from flashdraft.target.engine import warn_last_layer
from flashdraft.vllm_env import VLLM_VERSION, engine_python

ENGINES = ("vllm",)
TAU_TOLERANCE = 0.02  # relative difference of the pooled taus called out as a disagreement
# Why the engine check is greedy only (docs/evaluation.md, "Sampled checks"): refused rather than a
# verdict that cannot be trusted. Found by tests/test_engine.py's canary of the pinned build.
SAMPLED_UNVERIFIED = (
    f"sampled engine checks are not verified: vLLM {VLLM_VERSION}'s CPU build spreads each request's temperature, "
    "top-p and top-k over its draft positions with a kernel that fills only int64 tensors (_expand_kernel_impl in "
    "vllm/utils/cpu_triton_utils.py), so its verifier divides the target's logits by uninitialised memory and reads "
    "a garbage top-k (its out-of-bounds crash); greedy requests never take that path. vLLM also drafts greedily by "
    "default where flashdraft samples its drafts, so the taus would differ even on a sound build")
_WORKER = WORKERS / "engine_worker.py"


def run_vllm(target, drafters: list[tuple[str, int]], prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, dtype: str = "float32",
             plain: bool = True, timeout: float = 1800, kv_cache_gib: int = 1, python=None, log=print) -> dict:
    """Decode ``prompts`` with vLLM, speculative with each export of ``drafters`` ((directory,
    num_speculative_tokens) pairs; one engine start for all) and plain when ``plain``, in the
    engine environment; the worker's result (engine_worker.py). An engine error comes back as
    ``result["error"]``, a drafter's as its entry's ``error`` (the engine's own message). ``python``:
    the interpreter the user names (flashdraft.vllm_env.engine_python; None: the default)."""
    python = engine_python(python, log=log)
    model_len = max(len(p) for p in prompts) + max_new_tokens + 2 * (max(n for _, n in drafters) + 1)
    request = {"target": str(Path(target).resolve()),
               "drafters": [{"path": str(Path(d).resolve()), "num_speculative_tokens": int(n)} for d, n in drafters],
               "prompts": [[int(t) for t in p] for p in prompts], "max_new_tokens": int(max_new_tokens),
               "eos_ids": [int(t) for t in eos_ids], "temperature": float(temperature), "top_p": float(top_p),
               "top_k": int(top_k), "seed": int(seed), "dtype": dtype, "plain": bool(plain), "max_model_len": model_len}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": ""}
    return run_worker(python, _WORKER, request, what="vLLM", env=env, timeout=timeout)


def compare(flashdraft_steps: list[list[int]], flashdraft_tokens: list[list[int]], engine: dict,
            tolerance: float = TAU_TOLERANCE, greedy: bool = True) -> dict:
    """The engine check's verdict from flashdraft's per-prompt steps (counted as the engine
    counts them) and outputs, and the worker's result ``engine``."""
    from flashdraft.speculative import tau_per_prompt

    counters = engine["counters"]
    drafts = counters["num_drafts"]
    engine_steps = [[a for _, a in steps] for steps in engine["steps"]] if engine.get("steps") is not None else None
    report = {
        "vllm_version": engine.get("vllm_version"),
        "vllm": {
            "tau_pooled": 1 + counters["num_accepted_tokens"] / drafts if drafts else float("nan"),
            "tau": tau_per_prompt(engine_steps) if engine_steps is not None else None,
            "drafts": drafts, "accepted_tokens": counters["num_accepted_tokens"],
            "per_position_acceptance": [a / drafts for a in counters["accepted_per_position"]] if drafts else [],
        },
        "flashdraft": side(flashdraft_steps, count="drafts"),
        "tolerance": tolerance,
    }
    a, b = report["vllm"]["tau_pooled"], report["flashdraft"]["tau_pooled"]
    report["tau_agrees"] = bool(abs(a - b) <= tolerance * max(a, b))
    if greedy:
        report.update(agreement(engine["speculative"], engine.get("plain"), flashdraft_tokens, engine_steps,
                                flashdraft_steps))
    return report


def engine_check(target_dir, drafter_dir, prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
                 sampling=None, device: str = "cpu", tolerance: float = TAU_TOLERANCE, python=None,
                 log=print) -> dict:
    """flashdraft's decode and vLLM's of ``prompts`` with the export in ``drafter_dir`` (module
    doc); fp32 on both sides, vLLM under ``python`` (the interpreter the user names; None: the
    default, flashdraft.vllm_env). Raises ``EngineUnavailable`` where the engine cannot run."""
    (report,) = engine_checks(target_dir, [drafter_dir], prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              sampling=sampling, device=device, tolerance=tolerance, python=python, log=log)
    return report


def engine_checks(target_dir, drafter_dirs: list, prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
                  sampling=None, device: str = "cpu", tolerance: float = TAU_TOLERANCE, python=None,
                  log=print) -> list[dict]:
    """``engine_check`` of several exports of one target, in one engine call: vLLM starts once and
    decodes plain once for all of them (a start costs tens of seconds on a CPU). One report per
    export, in order."""
    from flashdraft.drafter import serving
    from flashdraft.speculative import GREEDY

    sampling = sampling or GREEDY
    if not sampling.greedy:
        raise ValueError(SAMPLED_UNVERIFIED)
    decoded, drafters = [], []
    for drafter_dir in drafter_dirs:
        cfg = serving.read_config(drafter_dir)
        warn_last_layer(cfg["dflash_config"]["target_layer_ids"], int(cfg.get("num_target_layers") or 0))
        decoded.append(_flashdraft_decode(target_dir, drafter_dir, cfg, prompts, max_new_tokens, eos_ids, sampling,
                                          device))
        drafters.append((drafter_dir, int(cfg["dflash_config"].get("block_size") or cfg["block_size"]) - 1))
    log(f"vLLM {VLLM_VERSION}: decoding {len(prompts)} prompts with {len(drafters)} export(s) "
        "(and plain, the greedy reference)")
    engine = run_vllm(target_dir, drafters, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                      plain=sampling.greedy, python=python, log=log)
    if "error" in engine:
        return [{"engine_error": engine["error"], "vllm_version": engine.get("vllm_version")} for _ in drafters]
    return [_report(gens, {**served, "vllm_version": engine["vllm_version"], "plain": engine.get("plain")}, sampling,
                    max_new_tokens, speculative_tokens, tolerance)
            for gens, served, (_, speculative_tokens) in zip(decoded, engine["drafters"], drafters)]


def _flashdraft_decode(target_dir, drafter_dir, cfg: dict, prompts, max_new_tokens: int, eos_ids, sampling,
                       device: str) -> list:
    """flashdraft's decode of ``prompts`` with the export (fp32, as the engine decodes): one
    Generation per prompt, a sampled prompt i seeded with sampling.seed + i."""
    import dataclasses

    import torch

    from flashdraft.drafter import DFlashDrafter
    from flashdraft.speculative import speculative_generate
    from flashdraft.target import TargetModel

    target = TargetModel.from_pretrained(target_dir, target_layer_ids=cfg["dflash_config"]["target_layer_ids"],
                                         device=device, dtype="float32")
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=torch.float32, device=device).eval()
    gens = []
    for i, prompt in enumerate(prompts):
        each = sampling if sampling.greedy else dataclasses.replace(sampling, seed=sampling.seed + i)
        gens.append(speculative_generate(target, drafter, prompt, max_new_tokens, eos_ids, sampling=each))
    return gens


def _report(gens: list, engine: dict, sampling, max_new_tokens: int, speculative_tokens: int,
            tolerance: float) -> dict:
    """One export's verdict from flashdraft's generations and the engine's result for it."""
    from flashdraft.speculative import tau_per_prompt, tau_pooled

    if "error" in engine:
        return {"engine_error": engine["error"], "vllm_version": engine.get("vllm_version")}
    steps = [g.engine_accepted for g in gens]
    report = compare(steps, [g.tokens for g in gens], engine, tolerance, greedy=sampling.greedy)
    # flashdraft's own figures as flashdraft eval reports them (the last step trimmed at eos / the limit)
    report["flashdraft"]["tau_trimmed"] = tau_per_prompt([g.accepted for g in gens])
    report["flashdraft"]["tau_pooled_trimmed"] = tau_pooled([g.accepted for g in gens])
    report["settings"] = {"greedy": sampling.greedy, "num_prompts": len(gens), "max_new_tokens": max_new_tokens,
                          "num_speculative_tokens": speculative_tokens, "dtype": "float32",
                          **({} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                         "top_k": sampling.top_k, "seed": sampling.seed})}
    return report


def format_check(report: dict) -> str:
    """One paragraph for a person: both sides' taus, losslessness, step agreement, the verdict."""
    if "engine_error" in report:
        return f"vLLM could not serve the drafter: {report['engine_error']}"
    lines = [side_line(f"vLLM {report['vllm_version']}", report["vllm"], count="drafts"),
             side_line("flashdraft (counted as vLLM counts)", report["flashdraft"], count="drafts"),
             *agreement_lines(report, "vLLM speculative", "vLLM plain greedy")]
    if not report["tau_agrees"]:
        lines.append(f"WARNING: the pooled taus differ by more than {100 * report['tolerance']:.0f}%: the engine does "
                     "not accept the drafter as flashdraft measured it (a last-layer tap? another target?)")
    return "\n".join(lines)
