"""The vLLM side of `flashdraft eval --engine vllm`: run inside the engine environment's Python.

    <engine python> engine_worker.py REQUEST.json RESULT.json

This file imports only the standard library, vLLM and ``worker_io`` beside it (never flashdraft or
the flashdraft environment's torch): flashdraft.judge.engine writes the request, starts this script
with the engine environment's interpreter, and reads the result. Request fields: ``target``, ``drafters`` (the
exports to judge, each ``{"path", "num_speculative_tokens"}``: one engine start and one plain
decode serve them all), ``prompts`` (token ids), ``max_new_tokens``, ``eos_ids`` (stop tokens;
[] runs to ``max_new_tokens``), ``temperature`` / ``top_p`` / ``top_k`` / ``seed``, ``dtype``,
``plain`` (also decode without a drafter: the greedy reference). The result holds the plain
decoding's tokens and, per drafter (``drafters``, in request order), its speculative tokens, the
engine's own spec-decode counters (as its metrics pool them over every step of every request of
that drafter) and, per prompt, each verification step's (drafts, accepted) as vLLM's scheduler
counted it; or that drafter's ``error``.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the per-step record can be
read where vLLM's scheduler makes its spec-decode statistics (``make_spec_decoding_stats``, which
is given the request id); without that hook (another vLLM version) the per-step record is None and
only the pooled counters are reported.
"""

from __future__ import annotations

import gc
import os
import sys

from worker_io import failure, serve


def _counters(llm) -> dict:
    """vLLM's pooled spec-decode counters from its metrics snapshot."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            out["accepted_per_position"] = [int(v) for v in metric.values]
    return out


def _since(after: dict, before: dict) -> dict:
    """The counters one drafter's decode added: the metrics registry may outlive an LLM."""
    padded = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    return {**{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "accepted_per_position": [a - b for a, b in zip(after["accepted_per_position"], padded)]}


def _record_steps():
    """Wrap the scheduler's per-request spec-decode bookkeeping to log (drafts, accepted) per step."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return None
    original = getattr(Scheduler, "make_spec_decoding_stats", None)
    if original is None:
        return None
    steps: dict[str, list[tuple[int, int]]] = {}

    def make_spec_decoding_stats(self, stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        if num_draft_tokens:
            invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
            steps.setdefault(request_id, []).append((num_draft_tokens - invalid, num_accepted_tokens))
        return original(self, stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)

    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    return steps


def _generate(llm, request: dict) -> tuple[list[list[int]], list[str]]:
    from vllm import SamplingParams

    eos = list(request["eos_ids"])
    params = []
    for i in range(len(request["prompts"])):
        sampled = request["temperature"] > 0
        params.append(SamplingParams(
            max_tokens=request["max_new_tokens"], temperature=request["temperature"],
            top_p=request["top_p"] if sampled else 1.0, top_k=request["top_k"] if sampled and request["top_k"] else -1,
            seed=request["seed"] + i if sampled else None, ignore_eos=True, stop_token_ids=eos or None,
            detokenize=False))
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.request_id for o in outputs]


def _llm(request: dict, drafter: dict | None = None):
    """The engine on the target; speculative with ``drafter`` (an entry of ``request["drafters"]``)."""
    from vllm import LLM

    kwargs = dict(model=request["target"], skip_tokenizer_init=True, dtype=request["dtype"], enforce_eager=True,
                  max_model_len=request["max_model_len"], seed=request["seed"], disable_log_stats=False,
                  max_num_seqs=request.get("max_num_seqs", 16))
    if drafter is not None:
        kwargs["speculative_config"] = {"method": "dflash", "model": drafter["path"],
                                        "num_speculative_tokens": drafter["num_speculative_tokens"]}
    return LLM(**kwargs)


def _speculative(request: dict, drafter: dict, steps: dict | None) -> dict:
    """One export's speculative decode: its tokens, counters and per-step record, or its error."""
    out: dict = {}
    try:
        if steps is not None:
            steps.clear()  # request ids start again at 0 in each engine
        llm = _llm(request, drafter)
        before = _counters(llm)
        out["speculative"], ids = _generate(llm, request)
        out["counters"] = _since(_counters(llm), before)
        # the scheduler knows a request by its id plus a random suffix ("0-1f3a..."): match on the prefix
        by_id = {key.rsplit("-", 1)[0]: value for key, value in (steps or {}).items()}
        out["steps"] = None if steps is None else [by_id.get(i, []) for i in ids]
        del llm
        gc.collect()
    except Exception as exc:  # the engine's own reason, for this drafter's report
        out = failure(exc)
    return out


def work(request: dict, result: dict) -> None:
    import vllm

    result["vllm_version"] = vllm.__version__
    if request.get("plain"):
        llm = _llm(request)
        result["plain"], _ = _generate(llm, request)
        del llm
        gc.collect()
    steps = _record_steps()
    result["drafters"] = [_speculative(request, drafter, steps) for drafter in request["drafters"]]


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(serve(work))
