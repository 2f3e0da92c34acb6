"""The engine side of flashdraft's vLLM target: a long-lived vLLM engine that prefills whole
samples and hands their captured hidden states over (flashdraft.target.engine drives it).

    <engine python> feature_worker.py '<start JSON>'

Imports the standard library and vLLM only (vLLM brings torch); never flashdraft. The start JSON:
``model`` (a Hugging Face directory), ``aux_layer_ids`` (vLLM's ids of the layers to capture,
ascending: the mapping from flashdraft's taps is flashdraft's, not this file's), ``storage`` (the
directory the connector writes each request's file to: a tmpfs), ``dtype``, ``max_model_len``,
``seed`` and ``engine_args`` (further ``vllm.LLM`` keyword arguments, passed through).

The protocol is JSON lines. Standard output is flashdraft's channel alone: everything else this
process prints (vLLM logs to standard output) is sent to standard error, which flashdraft keeps in
a log file.

- out, once: ``{"ready": {"vllm_version", "hidden_size", "num_layers", "dtype", "aux_layer_ids"}}``
  or ``{"error": ..., "traceback": ...}`` (then the process exits);
- in: ``{"prefill": [[token ids], ...]}``; out: ``{"paths": [...]}``, one file per sample in order
  (hidden_states_connector.py: ``hidden_states [T, n_aux, H]``, ``token_ids [T]``; read it under its
  lock, then remove it and the lock), or ``{"error": ..., "traceback": ...}``;
- end of input: the engine shuts down and the process exits 0.

Each sample is one request of one prefill with ``max_tokens=1`` (the sampled token is ignored).
Prefix caching is off: every sample's states come from its own prefill, never from another's
cached blocks.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback

CONNECTOR = "FlashdraftHiddenStates"  # hidden_states_connector.py, loaded by vLLM by module name
CONNECTOR_MODULE = "hidden_states_connector"
# Engine steps allowed after a prefill returns for the connector to hand every file over (one is
# enough: the finished requests' saves go out with the next step's connector metadata).
_DRAIN_STEPS = 100


def _engine(start: dict):
    from vllm import LLM

    capture = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": start["aux_layer_ids"]}}}
    transfer = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": start["storage"]}}
    return LLM(model=start["model"], skip_tokenizer_init=True, dtype=start["dtype"], seed=start["seed"],
               max_model_len=start["max_model_len"], enable_prefix_caching=False, enforce_eager=True,
               speculative_config=capture, kv_transfer_config=transfer, **start["engine_args"])


def _drain(llm) -> None:
    """Step the engine until the connector has handed every finished request's file over.

    ``generate`` returns once every request has its token; the connector's write of a finished
    request is scheduled with the NEXT engine step's metadata. An engine core in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) steps only when asked, so ask until its scheduler holds no
    request (their blocks are released once written). An engine core in its own process keeps
    stepping by itself; the reader's wait on each file's lock covers that case."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return
    for _ in range(_DRAIN_STEPS):
        if not scheduler.has_requests():
            return
        llm.llm_engine.step()
    raise RuntimeError(f"the engine still holds finished requests after {_DRAIN_STEPS} steps: the hidden-states "
                       "connector did not hand their files over")


def _prefill(llm, samples: list[list[int]]) -> list[str]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in samples],
                           SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    _drain(llm)
    paths = []
    for i, out in enumerate(outputs):
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"request {i} came back without a hidden_states_path: the connector {CONNECTOR} did "
                               "not see it")
        paths.append(path)
    return paths


def _ready(llm, start: dict) -> dict:
    import vllm

    model_config = llm.llm_engine.model_config
    text = model_config.hf_config.get_text_config()
    return {"vllm_version": vllm.__version__, "hidden_size": int(model_config.get_hidden_size()),
            "num_layers": int(text.num_hidden_layers), "dtype": str(model_config.dtype).removeprefix("torch."),
            "aux_layer_ids": start["aux_layer_ids"]}


def _error(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def main(start_json: str) -> int:
    channel = os.fdopen(os.dup(1), "w")  # the protocol's own descriptor, before anyone prints
    os.dup2(2, 1)  # vLLM's logs and any print: to standard error

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    start = json.loads(start_json)
    try:
        import vllm  # noqa: F401  (its absence is the most likely failure: say so before anything else)
    except ImportError as exc:
        send({"error": f"no vLLM in {sys.executable} ({exc}): install vllm in that environment"})
        return 1
    try:
        llm = _engine(start)
        send({"ready": _ready(llm, start)})
    except Exception as exc:  # the engine's own reason, for flashdraft to show
        send(_error(exc))
        return 1
    try:
        for line in sys.stdin:
            request = json.loads(line)
            try:
                send({"paths": _prefill(llm, request["prefill"])})
            except Exception as exc:  # this batch failed; flashdraft decides whether the run goes on
                send(_error(exc))
    finally:  # flashdraft removes it too; this covers a flashdraft that died (a tmpfs holds RAM)
        shutil.rmtree(start["storage"], ignore_errors=True)
    return 0


if __name__ == "__main__":  # vLLM may start processes that import this module: nothing runs on import
    sys.exit(main(sys.argv[1]))
