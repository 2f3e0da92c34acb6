"""The DFlash authors' reference decoder as a judge: an export decoded by their own code, next to flashdraft's decode.

The reference is the PyPI package ``dflash`` (its ``DFlashDraftModel`` / ``DFlash2DraftModel`` and
``dflash_generate``). flashdraft never imports it: it is installed without its pinned extras
(``pip install --no-deps``: torch and transformers come from the environment) into flashdraft's
engine environment (flashdraft.vllm_env, which shares this environment's torch; an interpreter the
user names must have it already: flashdraft installs nothing there), and
``workers/reference_worker.py`` runs there, a request and a result file as JSON in between
(protocol.run_worker).

``reference_check`` decodes the same prompts both ways, greedy, fp32 on CPU, and compares
(docs/evaluation.md): the reference's output against the target's plain greedy (lossless) and
against flashdraft's, and each prompt's per-step accepted drafts (both trim the last step at eos /
the token limit) step for step: equal at every step means the same drafts were proposed. Where the
package's class leaves some of the export's weights unused (its loading report), the report says
so: the reference then decodes a different drafter (e.g. without attention sinks).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from flashdraft.judge.protocol import WORKERS, agreement, agreement_lines, run_worker, side, side_line
from flashdraft.vllm_env import EngineUnavailable, engine_python, has_module, is_flashdraft_build

DFLASH_VERSION = "0.1.0"
DFLASH_PACKAGE = f"dflash=={DFLASH_VERSION}"
_WORKER = WORKERS / "reference_worker.py"


def reference_python(python=None, log=print) -> Path:
    """The engine environment's interpreter with ``dflash`` installed (in flashdraft's own build:
    once, without its pinned extras; one the user names, ``python`` or FLASHDRAFT_ENGINE_PYTHON,
    must have it). Raises ``EngineUnavailable`` with the reason where it cannot be had."""
    python = engine_python(python, log=log)
    if not is_flashdraft_build(python):
        if has_module(str(python), "dflash") is not True:
            raise EngineUnavailable(f"the engine interpreter {python} has no dflash, and flashdraft installs nothing "
                                    f"into an interpreter it did not build: `{python} -m pip install --no-deps "
                                    f"{DFLASH_PACKAGE}`, or use flashdraft's CPU build")
        return python
    ready = python.parent.parent / f".dflash-{DFLASH_VERSION}-ready"
    if ready.is_file():
        return python
    log(f"installing the DFlash reference decoder ({DFLASH_PACKAGE}, --no-deps) into {python.parent.parent}")
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", DFLASH_PACKAGE],
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
        raise EngineUnavailable(f"installing {DFLASH_PACKAGE} failed:\n{tail}")
    ready.write_text(DFLASH_VERSION + "\n")
    return python


def run_reference(target, drafter, prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
                  timeout: float = 1800, python=None, log=print) -> dict:
    """Decode ``prompts`` greedily with the reference decoder and the export ``drafter``; the
    worker's result (workers/reference_worker.py). The package's error comes back as
    ``result["error"]``."""
    python = reference_python(python, log=log)
    request = {"target": str(Path(target).resolve()), "drafter": str(Path(drafter).resolve()),
               "prompts": [[int(t) for t in p] for p in prompts], "max_new_tokens": int(max_new_tokens),
               "eos_ids": [int(t) for t in eos_ids]}
    # PYTHONPATH cleared: the worker sees the environment's packages, not a checkout's flashdraft
    return run_worker(python, _WORKER, request, what="reference", env={**os.environ, "PYTHONPATH": ""},
                      timeout=timeout)


def full_block_steps(steps: list[int], block_size: int, max_new_tokens: int) -> int:
    """How many of a prompt's reference steps drafted a whole block: ``dflash_generate`` drafts
    only as many positions as tokens are left (``verify_size = min(block_size, max_length -
    start)``), flashdraft (like vLLM, and like training) always a whole block and trims. With
    in-block bidirectional attention a shortened block proposes other drafts, so the two sides
    are compared step for step up to there."""
    generated = 1  # the prefill's token
    for k, accepted in enumerate(steps):
        if max_new_tokens - generated + 1 < block_size:
            return k
        generated += accepted + 1
    return len(steps)


def compare_reference(flashdraft_steps: list[list[int]], flashdraft_tokens: list[list[int]], reference: dict,
                      block_size: int, max_new_tokens: int) -> dict:
    """The verdict from flashdraft's per-prompt steps (trimmed at eos / the limit, as the
    reference trims) and outputs, and the worker's result ``reference``."""
    steps = reference["steps"]
    found = agreement(reference["outputs"], reference["plain"], flashdraft_tokens, steps, flashdraft_steps)
    full = [full_block_steps(s, block_size, max_new_tokens) for s in steps]
    differ_in_full = [i for i in found["prompts_with_other_steps"]
                      if steps[i][:full[i]] != flashdraft_steps[i][:full[i]]]
    unused = reference.get("loading", {}).get("unexpected_keys", [])
    missing = reference.get("loading", {}).get("missing_keys", [])
    return {
        "dflash_version": reference.get("dflash_version"), "drafter_class": reference.get("drafter_class"),
        "reference": side(steps), "flashdraft": side(flashdraft_steps), **found,
        # the same drafts at every step where the reference drafted a whole block (full_block_steps)
        "same_full_block_steps": not differ_in_full and len(steps) == len(flashdraft_steps),
        "prompts_with_other_full_block_steps": differ_in_full,
        "other_steps": {i: {"reference": steps[i], "flashdraft": flashdraft_steps[i], "full_block_steps": full[i]}
                        for i in found["prompts_with_other_steps"]},
        # weights of the export the package's class does not have (it decodes without them) / lacks
        "unused_weights": unused, "missing_weights": missing,
    }


def reference_check(target_dir, drafter_dir, prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
                    python=None, log=print) -> dict:
    """flashdraft's greedy decode and the reference decoder's of ``prompts`` with the export in
    ``drafter_dir`` (module doc); fp32 on CPU. Raises ``EngineUnavailable`` where the reference
    cannot be installed or run; the package's own error is ``report["reference_error"]``."""
    import torch

    from flashdraft.drafter import DFlashDrafter, serving
    from flashdraft.speculative import speculative_generate
    from flashdraft.target import TargetModel

    cfg = serving.read_config(drafter_dir)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    block_size = int(cfg["dflash_config"].get("block_size") or cfg["block_size"])
    target = TargetModel.from_pretrained(target_dir, target_layer_ids=layer_ids, device="cpu", dtype="float32")
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=torch.float32, device="cpu").eval()
    gens = [speculative_generate(target, drafter, prompt, max_new_tokens, eos_ids) for prompt in prompts]
    del target, drafter
    log(f"dflash {DFLASH_VERSION}: decoding {len(prompts)} prompts with the authors' reference decoder")
    reference = run_reference(target_dir, drafter_dir, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              python=python, log=log)
    if "error" in reference:
        return {"reference_error": reference["error"], "dflash_version": reference.get("dflash_version")}
    report = compare_reference([g.accepted for g in gens], [g.tokens for g in gens], reference, block_size,
                               max_new_tokens)
    report["settings"] = {"greedy": True, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
                          "dtype": "float32"}
    return report


def format_reference(report: dict) -> str:
    """One paragraph for a person: both sides' taus, losslessness, step agreement, unused weights."""
    if "reference_error" in report:
        return f"the DFlash reference decoder could not decode the drafter: {report['reference_error']}"
    lines = [side_line(f"reference (dflash {report['dflash_version']}, {report['drafter_class']})",
                       report["reference"]),
             side_line("flashdraft", report["flashdraft"]),
             *agreement_lines(report, "reference", "target greedy", differ_more=(
                 f"; in whole-block steps: {report['prompts_with_other_full_block_steps'] or 'none'}"))]
    if report["unused_weights"] or report["missing_weights"]:
        lines.append(f"WARNING: the reference's class left export weights unused {report['unused_weights']} / "
                     f"uninitialised {report['missing_weights']}: it decodes another drafter than flashdraft's")
    return "\n".join(lines)
