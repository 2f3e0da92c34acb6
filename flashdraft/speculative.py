"""Speculative decoding with a DFlash drafter: the real greedy draft / verify loop, and tau.

The loop (DFLASH.md): prefill the target on the prompt; its taps become the drafter's context
and its argmax the first token x. Each step drafts [x, MASK * (bs - 1)] in ONE drafter forward,
verifies [x, d1 .. d(bs-1)] in ONE target forward, accepts the longest prefix of drafts equal to
the target's argmax, commits it plus the target's own next token (the bonus), rewinds the target
cache to the kept tokens (cropping attention layers; a hybrid target's recurrent layers are
restored and re-run over the kept tokens, target.rewind_cache) and appends the verified rows'
taps to the drafter's context. tau of a step is
accepted + 1; greedy verification makes the output identical to the target's greedy output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel, mark_cache, rewind_cache


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), eos included if produced
    accepted: list[int] = field(default_factory=list)  # per step: drafts accepted (0 .. bs-1)
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verification (accepted + 1)."""
        return float(np.mean(self.accepted) + 1) if self.accepted else float("nan")


def _stop_index(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> int:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return i + 1
    return min(len(tokens), max_new_tokens)


@torch.no_grad()
def greedy_generate(target: TargetModel, prompt: list[int], max_new_tokens: int, eos_ids=()) -> Generation:
    """Plain greedy decoding with the target's KV cache: the losslessness reference."""
    eos_ids = set(eos_ids)
    begin = time.perf_counter()
    cache = target.new_cache()
    ids = torch.tensor([prompt], device=target.device)
    logits, _ = target.forward_with_cache(ids, cache, 0)
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        step = torch.tensor([[out[-1]]], device=target.device)
        logits, _ = target.forward_with_cache(step, cache, len(prompt) + len(out) - 1)
        out.append(int(logits[0, -1].argmax()))
    return Generation(out, seconds=time.perf_counter() - begin)


def _draft_and_verify(target: TargetModel, prompt: list[int], max_new_tokens: int, eos_ids, propose,
                      on_verified=None) -> Generation:
    """The verification loop shared by every drafter.

    ``propose(x, tokens)`` returns the draft tokens that should follow the last committed
    token x (``tokens``: prompt + output so far). ``on_verified(taps, accepted)`` receives the
    prefill taps (accepted None), then after each step the taps of x, d1..da (DFlash's context).
    """
    eos_ids = set(eos_ids)
    device = target.device
    begin = time.perf_counter()
    cache = target.new_cache()
    logits, taps = target.forward_with_cache(torch.tensor([prompt], device=device), cache, 0)
    if on_verified:
        on_verified(taps, None)
    x = int(logits[0, -1].argmax())
    out, accepted_log = [x], []
    start = len(prompt)  # position of x
    while len(out) < max_new_tokens and x not in eos_ids:
        drafts = propose(x, prompt + out)
        mark = mark_cache(cache)
        logits, taps = target.forward_with_cache(torch.tensor([[x] + drafts], device=device), cache, start)
        predicted = logits[0].argmax(-1).tolist()  # predicted[i]: the target's token for position start + i + 1
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
            accepted += 1
        committed = drafts[:accepted] + [predicted[accepted]]  # the accepted drafts + the bonus token
        out.extend(committed)
        accepted_log.append(accepted)
        rewind_cache(target, cache, mark, [x] + drafts[:accepted])  # keep x, d1..da
        if on_verified:
            on_verified(taps[:, : accepted + 1], accepted)
        start += accepted + 1
        x = out[-1]
        if any(t in eos_ids for t in committed):
            break
    stop = _stop_index(out, eos_ids, max_new_tokens)
    if accepted_log and stop < len(out):
        # The last step crossed eos or max_new_tokens: count only the tokens it added that are
        # kept (at least the first), as tau is tokens output per verification.
        accepted_log[-1] -= len(out) - stop
    return Generation(out[:stop], accepted_log, time.perf_counter() - begin)


@torch.no_grad()
def speculative_generate(
    target: TargetModel, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int, eos_ids=()
) -> Generation:
    """Greedy DFlash speculative decoding of one prompt (batch 1)."""
    device = target.device
    context = drafter.new_cache()
    dtype = next(drafter.parameters()).dtype
    mask_ids = torch.full((1, drafter.block_size - 1), drafter.mask_token_id, device=device)

    def propose(x: int, tokens: list[int]) -> list[int]:
        # One drafter forward over [x, MASK...] at positions start .. start + bs - 1.
        block = torch.cat([torch.tensor([[x]], device=device), mask_ids], dim=1)
        hidden = drafter.forward_block(context, target.embed(block).to(dtype))
        return target.lm_head(hidden[:, 1:].to(target.dtype)).argmax(-1)[0].tolist()

    def extend(taps: torch.Tensor, accepted: int | None) -> None:
        drafter.extend_context(context, taps.to(dtype))  # verified rows become drafter context

    return _draft_and_verify(target, prompt, max_new_tokens, eos_ids, propose, extend)


def ngram_draft(history: list[int], num_draft: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafting: copy what followed the last earlier occurrence of the suffix.

    Tries suffixes of length max_ngram down to 1; returns up to ``num_draft`` tokens ([] if no
    earlier occurrence).
    """
    arr = np.asarray(history)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        suffix = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            begin = hits[-1] + n
            return arr[begin : begin + num_draft].tolist()
    return []


@torch.no_grad()
def ngram_generate(
    target: TargetModel, prompt: list[int], max_new_tokens: int, block_size: int, eos_ids=(), max_ngram: int = 3
) -> Generation:
    """The no-model baseline: n-gram drafts of block_size - 1 tokens, verified like DFlash."""
    return _draft_and_verify(target, prompt, max_new_tokens, eos_ids,
                             lambda x, tokens: ngram_draft(tokens, block_size - 1, max_ngram))
