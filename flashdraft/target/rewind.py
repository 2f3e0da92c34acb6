"""Rewinding the target's KV cache after a verification: the draft / verify loop's rollback.

A verification forward feeds [x, d1 .. d(bs-1)] and keeps only x, d1 .. da. Each kind of
cache layer is undone its own way, and each kind flashdraft knows is described here explicitly:

- ``attention`` (``DynamicLayer``, ``DynamicSlidingWindowLayer``): keys and values per position,
  cropped back with the layer's public ``crop`` (whose argument changed meaning in 5.24: the
  parameter's name says which convention, and the length after it is checked).
- ``linear`` (``LinearAttentionLayer``: the gated delta nets of Qwen3.5 / Qwen3-Next, conv
  states): one fixed-size state that every forward overwrites, so it cannot be cropped. Its
  state fields (``LINEAR_STATE``) are copied at the mark and restored; the target then re-runs
  the kept tokens. Fields that only configure the layer are listed too (``LINEAR_INERT``).
- ``stateless`` (``DummyLayer``): nothing to undo.

Anything else is refused by name (``UnsupportedCacheLayer``): another layer class, a linear
layer holding an attribute neither list names, or one recording its own past. Restoring
``vars()`` wholesale is how transformers 5.25 broke flashdraft silently: it added
``cumulative_length_linear``, a counter that ``DynamicCache.get_seq_length`` now returns as a
live 0-d tensor, so a length read at the mark kept moving after it. Lengths are read as ints
here (``cache_length``).

``check_rewind(target)`` is the self-check the decoders run once per target before decoding
(speculative._draft_and_verify): mark, verify, rewind, continue, compared with a cache that
never saw the rejected tokens. A rewind that is not exact stops there with ``RewindError``,
before any tau or "lossless" verdict is reported.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib.metadata import version

import torch

# A linear-attention layer's state: what a forward changes (restored at a rewind) ...
LINEAR_STATE = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                "is_recurrent_states_initialized", "conv_kernel_size", "cumulative_length_linear")
# ... and what only configures it (never changed by a forward while record_past is off).
# Attributes by release (tests/test_target.py runs on the range's ends; benchmarks/dependency_range.sh):
# max_batch_size until 5.12, batch_size in 5.13, number_of_states / record_past from 5.14,
# cumulative_length_linear (state) and the recording fields from 5.25.
LINEAR_INERT = ("number_of_states", "device", "dtype", "max_batch_size", "batch_size", "record_past",
                "recurrent_states_to_keep", "recurrent_states_history")
# The layer classes of transformers' DynamicCache, by kind (exact class names: a subclass may hold more).
KINDS = {"DynamicLayer": "attention", "DynamicSlidingWindowLayer": "attention",
         "LinearAttentionLayer": "linear", "DummyLayer": "stateless"}


class RewindError(RuntimeError):
    """The target's cache cannot be rewound exactly; speculative decoding on it would not be lossless."""

    names_the_fix = True  # the command line reports it as one line (cli.entry)


class UnsupportedCacheLayer(RewindError):
    """A cache layer of a kind flashdraft does not know how to rewind."""


def _transformers() -> str:
    return f"transformers {version('transformers')}"


def layer_kind(index: int, layer) -> str:
    """The kind of cache layer ``index`` (KINDS); refuses a layer it cannot rewind exactly, by name."""
    name = type(layer).__name__
    kind = KINDS.get(name)
    if kind is None:
        raise UnsupportedCacheLayer(
            f"cache layer {index} is a {name}, which flashdraft cannot rewind after a rejected draft "
            f"({_transformers()}; known kinds: {', '.join(sorted(KINDS))}); speculative decoding on this "
            "target is refused rather than done inexactly")
    if kind == "linear":
        unknown = sorted(set(vars(layer)) - set(LINEAR_STATE) - set(LINEAR_INERT))
        if unknown:
            raise UnsupportedCacheLayer(
                f"cache layer {index} ({name}, {_transformers()}) holds {unknown}, which flashdraft does not "
                "know how to rewind; add each to target/rewind.py's LINEAR_STATE (state a forward changes) "
                "or LINEAR_INERT, and check with tests/test_target.py")
        if getattr(layer, "record_past", False):
            raise UnsupportedCacheLayer(
                f"cache layer {index} ({name}) records its own past (activate_past_recording): flashdraft's "
                "rewind restores the state itself and does not mix with transformers' recording")
    return kind


def cache_length(cache) -> int:
    """Positions the cache holds, as an int (5.25's ``get_seq_length`` may return a live tensor)."""
    return int(cache.get_seq_length())


def _crop_layer(layer, length: int) -> None:
    """Crop one attention layer to ``length`` positions: ``crop(tokens_to_remove)`` takes a negative
    count (5.24 on), ``crop(max_length)`` the length to keep (before)."""
    current = int(layer.get_seq_length())
    if length < current:
        first = next(iter(inspect.signature(layer.crop).parameters))
        layer.crop(length - current if first == "tokens_to_remove" else length)
    if int(layer.get_seq_length()) != length:
        raise RewindError(f"{type(layer).__name__}.crop left {int(layer.get_seq_length())} positions, "
                          f"expected {length} ({_transformers()})")


def crop_cache(cache, length: int) -> None:
    """Crop an attention-only cache to its first ``length`` positions, layer by layer (a layer
    whose state cannot be cropped is refused: rewind those with mark_cache / rewind_cache)."""
    for i, layer in enumerate(cache.layers):
        kind = layer_kind(i, layer)
        if kind == "linear":
            raise RewindError(f"cache layer {i} ({type(layer).__name__}) holds a recurrent state, which "
                              "cropping cannot undo: use mark_cache / rewind_cache")
        if kind == "attention":
            _crop_layer(layer, length)


def _copy(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


@dataclass
class CacheMark:
    """A decoding cache's state before a verification forward (see mark_cache)."""

    length: int  # positions cached at the mark
    kinds: list[str]  # each layer's kind (layer_kind)
    states: dict[int, dict]  # linear layer index -> a copy of its LINEAR_STATE fields


def mark_cache(cache) -> CacheMark:
    """Remember what ``rewind_cache`` needs to undo the next forward: the length, which is all an
    attention layer needs (it is cropped), and a copy of each linear layer's state (conv and
    recurrent states: a few MB per layer, whatever the context length)."""
    kinds = [layer_kind(i, layer) for i, layer in enumerate(cache.layers)]
    states = {i: {f: _copy(getattr(layer, f)) for f in LINEAR_STATE if hasattr(layer, f)}
              for i, (layer, kind) in enumerate(zip(cache.layers, kinds)) if kind == "linear"}
    return CacheMark(cache_length(cache), kinds, states)


def rewind_cache(target, cache, mark: CacheMark, kept: list[int]) -> None:
    """Leave ``cache`` as if only ``kept`` had been fed after ``mark`` (a verification keeps the
    accepted prefix of the tokens it ran on).

    An attention-only cache is cropped. A hybrid target's linear layers are restored to the mark,
    its attention layers cropped back to the mark, and the target runs again over ``kept`` (one
    extra forward of at most a block's tokens, only when a draft was rejected). Exact: the result
    equals a cache that never saw the rejected tokens (tests/test_target.py, check_rewind)."""
    length = mark.length + len(kept)
    if cache_length(cache) == length:  # everything fed since the mark is kept
        return
    if not mark.states:
        crop_cache(cache, length)
        return
    for i, (layer, kind) in enumerate(zip(cache.layers, mark.kinds)):
        if kind == "linear":
            for name, value in mark.states.pop(i).items():  # the mark is spent: its copies become the state
                setattr(layer, name, value)
        elif kind == "attention":
            _crop_layer(layer, mark.length)
    target.forward_with_cache(torch.tensor([kept], device=target.device), cache, mark.length)
    if cache_length(cache) != length:
        raise RewindError(f"the rewound cache holds {cache_length(cache)} positions, expected {length} "
                          f"({_transformers()})")


# The self-check's tolerances, relative to each compared tensor's scale. Against the same forwards
# without the rejected tokens: fp32 agrees to rounding, half types by a few ulps (a kept row's keys
# were computed in a forward of another shape). Against one plain forward over the whole sequence:
# looser, as chunked and token-by-token kernels round differently (5.5's inexact continuation was 12 %).
_STATE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
_PLAIN_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_HALF_STATE_TOLERANCE, _HALF_PLAIN_TOLERANCE = 2e-2, 5e-2


def _tensors(value, path: str, out: dict) -> dict:
    """Every tensor under ``value`` (a layer's attributes, dicts, lists), by path; integers and
    booleans too, which must match exactly."""
    if torch.is_tensor(value) or isinstance(value, bool | int):
        out[path] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensors(v, f"{path}[{k!r}]", out)
    elif isinstance(value, list | tuple):
        for k, v in enumerate(value):
            _tensors(v, f"{path}[{k}]", out)
    return out


def _difference(got, want, tolerance: float) -> str | None:
    """Why ``got`` is not ``want`` (None: it is, within ``tolerance`` of want's scale)."""
    if not torch.is_tensor(want) or not want.is_floating_point():
        same = torch.equal(got, want) if torch.is_tensor(got) and torch.is_tensor(want) else got == want
        return None if same else f"{got!r} instead of {want!r}"
    if not torch.is_tensor(got) or got.shape != want.shape:
        return f"shape {tuple(getattr(got, 'shape', ()))} instead of {tuple(want.shape)}"
    error, scale = float((got - want).abs().max()), float(want.abs().max())
    allowed = tolerance * max(scale, 1e-6)
    return None if error <= allowed else f"off by {error:.3g} (allowed {allowed:.3g})"  # NaN fails too


def check_rewind(target, *, prompt: int = 9, block: int = 6, follow: int = 3) -> None:
    """The rewind self-check, once per target (a few forwards of a handful of tokens).

    For kept = 1 and block - 1 of a ``block``-token verification after a ``prompt``-token prefill:
    mark, verify, rewind, then ``follow`` more tokens. Against a fresh cache fed prompt, kept,
    follow in the same forwards, every tensor every cache layer holds (whatever this rewind
    thinks the state is), the length and the follow tokens' logits must agree; against one
    plain forward over prompt + kept + follow, the follow tokens' logits too (a cached
    multi-token forward that is itself inexact, as on transformers 5.5, fails there). Otherwise
    ``RewindError`` says what differs, by how much, on which transformers. Random token ids,
    seeded: every rank of a sharded target runs the same forwards."""
    if getattr(target, "rewind_checked", False):
        return
    vocab = int(target.embed.weight.shape[0])
    ids = torch.randint(0, vocab, (1, prompt + block + follow), generator=torch.Generator().manual_seed(0))
    ids = ids.to(target.device)
    head, verified, after = ids[:, :prompt], ids[:, prompt:prompt + block], ids[:, prompt + block:]
    tolerance = _STATE_TOLERANCE.get(target.dtype, _HALF_STATE_TOLERANCE)
    plain_tolerance = _PLAIN_TOLERANCE.get(target.dtype, _HALF_PLAIN_TOLERANCE)
    for kept in (1, block - 1):
        cache = target.new_cache()
        target.forward_with_cache(head, cache, 0)
        mark = mark_cache(cache)
        target.forward_with_cache(verified, cache, prompt)
        rewind_cache(target, cache, mark, verified[0, :kept].tolist())
        fresh = target.new_cache()
        target.forward_with_cache(head, fresh, 0)
        target.forward_with_cache(verified[:, :kept], fresh, prompt)
        found = {"length": _difference(cache_length(cache), cache_length(fresh), 0)}
        for i, (layer, want) in enumerate(zip(cache.layers, fresh.layers)):
            got_all, want_all = _tensors(vars(layer), "", {}), _tensors(vars(want), "", {})
            for path in sorted(set(got_all) | set(want_all)):
                found[f"layer {i} ({type(layer).__name__}) {path.lstrip('[').rstrip(']')}"] = (
                    _difference(got_all[path], want_all[path], tolerance) if path in got_all and path in want_all
                    else "present in only one of the two caches")
        logits, _ = target.forward_with_cache(after, cache, prompt + kept)
        expected, _ = target.forward_with_cache(after, fresh, prompt + kept)
        found["the next logits"] = _difference(logits, expected, tolerance)
        plain, _ = target.forward_with_cache(torch.cat([head, verified[:, :kept], after], 1), target.new_cache(), 0)
        found["the next logits against one plain forward"] = _difference(logits, plain[:, -follow:], plain_tolerance)
        wrong = [f"{what}: {why}" for what, why in found.items() if why]
        if wrong:
            raise RewindError(
                f"the target's KV-cache rewind is not exact on {_transformers()}: after keeping {kept} of "
                f"{block} verified tokens, the cache differs from one that never saw the rejected tokens "
                f"({'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''}). Speculative decoding would not "
                "be lossless and its tau would be wrong: install a transformers release in flashdraft's "
                "tested range (pyproject.toml), and report `flashdraft env` with this message")
    target.rewind_checked = True
