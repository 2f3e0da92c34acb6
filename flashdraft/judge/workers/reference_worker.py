"""Runs the DFlash authors' reference decoder (PyPI ``dflash``) in its own environment; never imported by flashdraft.

    python reference_worker.py REQUEST.json RESULT.json

Started by flashdraft.judge.reference.run_reference with the engine environment's interpreter
(which has ``dflash`` installed without its pinned extras); it must not import flashdraft
(``worker_io`` beside it is the protocol's worker side). The request names the target (a
transformers checkpoint), the drafter export, the token prompts, max_new_tokens and the eos ids.
The target is loaded with transformers, the drafter with the package's own class
(``DFlash2DraftModel`` where the export's ``architectures`` says so, else ``DFlashDraftModel``),
both fp32 on CPU, and each prompt is decoded greedily with the package's ``dflash_generate``. The
result has, per prompt, the reference's output tokens, its per-step accepted drafts (its
``acceptance_lengths`` less the bonus token), and the target's own greedy continuation (plain
decoding, whole-sequence forward each token: the lossless reference); also the drafter's loading
report (weights the package's class left unused or uninitialised), or the package's own error.

One adaptation, no change of logic: ``dflash_generate(return_stats=True)`` (the only way it
returns its acceptance lengths) times itself with ``torch.cuda.synchronize``, which a CPU build
refuses; the timer is replaced by ``time.perf_counter`` where CUDA is absent.
"""

from __future__ import annotations

import json
import sys
import time

from worker_io import serve


def _greedy(target, prompt: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    import torch

    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            token = int(target(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if token in eos_ids:
                break
    return out


def work(request: dict, result: dict) -> None:
    import dflash
    import dflash.model as reference
    import torch
    from transformers import AutoModelForCausalLM

    result["dflash_version"] = getattr(dflash, "__version__", None)
    try:
        from importlib.metadata import version

        result["dflash_version"] = version("dflash")
    except Exception:  # an unpacked copy without metadata: the attribute (or None) stands
        pass
    if not torch.cuda.is_available():
        reference._cuda_time = time.perf_counter  # timing only (module doc)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(request["target"], dtype=torch.float32).eval()
    config = json.loads(open(f"{request['drafter']}/config.json", encoding="utf-8").read())
    cls = (reference.DFlash2DraftModel if "DFlash2DraftModel" in (config.get("architectures") or [])
           else reference.DFlashDraftModel)
    result["drafter_class"] = cls.__name__
    drafter, info = cls.from_pretrained(request["drafter"], dtype=torch.float32, output_loading_info=True)
    drafter = drafter.eval()
    result["loading"] = {k: sorted(map(str, v)) for k, v in info.items() if k in (
        "missing_keys", "unexpected_keys", "mismatched_keys")}
    eos = [int(t) for t in request["eos_ids"]]
    result["outputs"], result["steps"], result["plain"] = [], [], []
    for prompt in request["prompts"]:
        input_ids = torch.tensor([prompt], dtype=torch.long)
        stats = reference.dflash_generate(drafter, target, input_ids, request["max_new_tokens"], eos or None,
                                          temperature=0.0, return_stats=True)
        result["outputs"].append(stats.output_ids[0, stats.num_input_tokens:].tolist())
        result["steps"].append([int(n) - 1 for n in stats.acceptance_lengths])
        result["plain"].append(_greedy(target, prompt, request["max_new_tokens"], eos))


if __name__ == "__main__":
    sys.exit(serve(work))
