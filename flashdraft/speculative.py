"""Speculative decoding with a DFlash drafter: the real greedy draft / verify loop, and tau.

The loop (DFLASH.md): prefill the target on the prompt; its taps become the drafter's context
and its argmax the first token x. Each step drafts [x, MASK * (bs - 1)] in ONE drafter forward,
verifies [x, d1 .. d(bs-1)] in ONE target forward, accepts the longest prefix of drafts equal to
the target's argmax, commits it plus the target's own next token (the bonus), crops the target
cache back and appends the verified rows' taps to the drafter's context. tau of a step is
accepted + 1; greedy verification makes the output identical to the target's greedy output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel, crop_cache


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


@torch.no_grad()
def speculative_generate(
    target: TargetModel, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int, eos_ids=()
) -> Generation:
    """Greedy DFlash speculative decoding of one prompt (batch 1)."""
    eos_ids = set(eos_ids)
    bs = drafter.block_size
    device = target.device
    begin = time.perf_counter()
    cache = target.new_cache()
    logits, taps = target.forward_with_cache(torch.tensor([prompt], device=device), cache, 0)
    context = drafter.new_cache()
    drafter.extend_context(context, taps.to(next(drafter.parameters()).dtype))
    x = int(logits[0, -1].argmax())
    out, accepted_log = [x], []
    start = len(prompt)  # position of x
    mask_ids = torch.full((1, bs - 1), drafter.mask_token_id, device=device)
    while len(out) < max_new_tokens and x not in eos_ids:
        # Draft: one drafter forward over [x, MASK...] at positions start .. start + bs - 1.
        block = torch.cat([torch.tensor([[x]], device=device), mask_ids], dim=1)
        hidden = drafter.forward_block(context, target.embed(block).to(context.keys[0].dtype))
        drafts = target.lm_head(hidden[:, 1:].to(target.dtype)).argmax(-1)  # [1, bs - 1]
        # Verify: one target forward over [x, d1 .. d(bs-1)].
        verify = torch.cat([block[:, :1], drafts], dim=1)
        logits, taps = target.forward_with_cache(verify, cache, start)
        predicted = logits[0].argmax(-1)  # predicted[i]: the target's token for position start + i + 1
        matches = (drafts[0] == predicted[:-1]).int()
        accepted = int(matches.cumprod(0).sum())  # host sync: the loop needs the count
        committed = drafts[0, :accepted].tolist() + [int(predicted[accepted])]
        out.extend(committed)
        accepted_log.append(accepted)
        # Keep x, d1..da in the target cache; their taps become drafter context.
        crop_cache(cache, start + accepted + 1)
        drafter.extend_context(context, taps[:, : accepted + 1].to(context.keys[0].dtype))
        start += accepted + 1
        x = out[-1]
        if any(t in eos_ids for t in committed):
            break
    stop = _stop_index(out, eos_ids, max_new_tokens)
    return Generation(out[:stop], accepted_log, time.perf_counter() - begin)


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
    eos_ids = set(eos_ids)
    device = target.device
    begin = time.perf_counter()
    cache = target.new_cache()
    logits, _ = target.forward_with_cache(torch.tensor([prompt], device=device), cache, 0)
    x = int(logits[0, -1].argmax())
    out, accepted_log = [x], []
    start = len(prompt)
    while len(out) < max_new_tokens and x not in eos_ids:
        drafts = ngram_draft(prompt + out, block_size - 1, max_ngram)
        verify = torch.tensor([[x] + drafts], device=device)
        logits, _ = target.forward_with_cache(verify, cache, start)
        predicted = logits[0].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
            accepted += 1
        committed = drafts[:accepted] + [predicted[accepted]]
        out.extend(committed)
        accepted_log.append(accepted)
        crop_cache(cache, start + accepted + 1)
        start += accepted + 1
        x = out[-1]
        if any(t in eos_ids for t in committed):
            break
    stop = _stop_index(out, eos_ids, max_new_tokens)
    return Generation(out[:stop], accepted_log, time.perf_counter() - begin)
