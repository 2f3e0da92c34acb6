"""The engine's features checked against the in-process forward, tap by tap.

A wrong capture still trains and still serves, only worse (SGLang's Gemma3 capture: GSM8K tau 1.06
until fixed, 1.89 after), so an engine's features are compared with transformers' before a run
trusts them: the same samples through both backends, each tap of each sample on its own. The
measure is the largest relative error of a token's row, ``max_t |e_t| / |r_t|`` (L2 norms over
the hidden size): a row's error against that row's own size, which a few huge activation
channels cannot hide the way they hide it in one max-abs ratio over the whole tap. The tolerance
is set by the dtype both computed in (``TOLERANCES``); the largest absolute error is reported
beside it.
"""

from __future__ import annotations

import torch

from flashdraft.target.engine import EngineError

# Largest relative row error accepted per dtype. Measured here (vLLM's CPU build against transformers
# on CPU, docs/benchmarks.md): fp32 3e-7 (a 4-layer Qwen3, hidden 64) to 3e-6 (hidden 1024, 8
# layers); bf16 1.1e-2 on the 4-layer one; an off-by-one tap is off by ~1. Half precisions leave
# room for a few ulps (bf16: 2^-8, fp16 8x finer) compounded over a deep target's layers by other
# kernels' rounding.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class EngineFeatureMismatch(EngineError):
    """The engine's features are not the in-process forward's: which tap, which sample, how far."""

    def __init__(self, tap: int, layer: int, aux_layer: int, sample: int, relative_error: float,
                 max_abs_error: float, tolerance: float, dtype: torch.dtype):
        self.tap, self.layer, self.aux_layer, self.sample = tap, layer, aux_layer, sample
        self.relative_error, self.max_abs_error, self.tolerance = relative_error, max_abs_error, tolerance
        super().__init__(
            f"the engine's features differ from the in-process forward at tap {tap} (target layer {layer}, read from "
            f"vLLM aux layer {aux_layer}), sample {sample}: relative error {relative_error:.2e} per token row "
            f"(tolerance {tolerance:.0e} in {str(dtype).removeprefix('torch.')}), largest absolute error "
            f"{max_abs_error:.2e}. A wrong capture trains and serves, only worse: check that the engine runs the same "
            "model directory and dtype, and report it with the engine's log")


def tap_errors(engine: torch.Tensor, reference: torch.Tensor, length: int, num_taps: int) -> list[tuple[float, float]]:
    """(relative error, largest absolute error) of each tap of one sample: ``engine`` and
    ``reference`` [S, K*H], compared over the first ``length`` rows."""
    e = engine[:length].float().view(length, num_taps, -1)
    r = reference[:length].float().view(length, num_taps, -1)
    diff = e - r
    relative = diff.norm(dim=-1) / r.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)  # [T, K]
    relative = relative.nan_to_num(nan=float("inf"))  # a NaN on either side is a mismatch, never a pass
    return [(float(relative[:, k].max()), float(diff[:, k].abs().nan_to_num(nan=float("inf")).max()))
            for k in range(num_taps)]


@torch.no_grad()
def check_engine_features(engine_target, reference_target, samples: list[list[int]], dtype: torch.dtype | None = None,
                          *, batch_size: int = 4) -> dict:
    """Compare ``samples`` (token ids, any lengths) through both targets, tap by tap.

    ``engine_target``: an EngineTarget (its ``aux_layer_ids``: where each tap was read from);
    ``reference_target``: a TargetModel of the same model
    with the same taps (its transformers forward). The samples go in right-padded batches of
    ``batch_size``, so padding is part of what is checked. ``dtype`` picks the tolerance
    (TOLERANCES; default: the engine target's dtype). Raises EngineFeatureMismatch for the worst
    (tap, sample) beyond the tolerance; else returns the report: per tap its layer, the vLLM aux
    layer it was read from, its largest relative and absolute errors and the sample they came from."""
    if list(reference_target.layer_ids) != list(engine_target.layer_ids):
        raise ValueError(f"the reference taps {reference_target.layer_ids}, the engine target "
                         f"{engine_target.layer_ids}: compare the same taps")
    if not samples:
        raise ValueError("check_engine_features needs at least one sample")
    dtype = dtype or engine_target.dtype
    tolerance = TOLERANCES[dtype]
    num_taps = len(engine_target.layer_ids)
    worst = [(0.0, 0.0, 0)] * num_taps  # per tap: (relative, absolute, sample)
    for first in range(0, len(samples), batch_size):
        chunk = samples[first:first + batch_size]
        seq = max(map(len, chunk))
        ids = torch.zeros(len(chunk), seq, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, sample in enumerate(chunk):
            ids[b, :len(sample)], mask[b, :len(sample)] = torch.tensor(sample), 1
        with engine_target.lock:
            engine = engine_target.features(ids.to(engine_target.device), mask.to(engine_target.device)).cpu()
        with reference_target.lock:
            reference = reference_target.features(ids.to(reference_target.device),
                                                  mask.to(reference_target.device)).cpu()
        for b, sample in enumerate(chunk):
            for k, (rel, err) in enumerate(tap_errors(engine[b], reference[b], len(sample), num_taps)):
                if rel > worst[k][0]:
                    worst[k] = (rel, err, first + b)
    taps = [{"tap": k, "layer": layer, "vllm_aux_layer": aux, "relative_error": rel, "max_abs_error": err,
             "sample": b}
            for k, (layer, aux, (rel, err, b)) in enumerate(zip(engine_target.layer_ids, engine_target.aux_layer_ids,
                                                                  worst))]
    bad = max(taps, key=lambda t: t["relative_error"])
    if bad["relative_error"] > tolerance:
        raise EngineFeatureMismatch(bad["tap"], bad["layer"], bad["vllm_aux_layer"], bad["sample"],
                                    bad["relative_error"], bad["max_abs_error"], tolerance, dtype)
    return {"samples": len(samples), "tokens": sum(map(len, samples)), "dtype": str(dtype).removeprefix("torch."),
            "tolerance": tolerance, "taps": taps}
