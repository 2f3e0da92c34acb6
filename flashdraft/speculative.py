"""Speculative decoding with a DFlash drafter: the real draft / verify loop, greedy or sampled, and tau.

The loop (DFLASH.md): prefill the target on the prompt; its taps become the drafter's context
and its next token x. Each step drafts [x, MASK * (bs - 1)] in ONE drafter forward, verifies
[x, d1 .. d(bs-1)] in ONE target forward, accepts a prefix of the drafts, commits it plus one
token of the target's own (the bonus, or the correction of the first rejected draft), rewinds
the target cache to the kept tokens (cropping attention layers; a hybrid target's recurrent
layers are restored and re-run over the kept tokens, target.rewind_cache) and appends the
verified rows' taps to the drafter's context. tau of a step is accepted + 1.

Greedy (temperature 0): the drafts are the drafter's argmax, accepted while they equal the
target's, and the output is the target's greedy output token for token. Sampled (temperature
> 0, ``Sampling``): each draft d_k is drawn from the drafter's q_k = softmax(logits / T) (the
slots are drafted in parallel, so q_k does not depend on the other drafts) and verified by
rejection sampling against the target's p_k (temperature, top-k, top-p applied): d_k is kept
with probability min(1, p_k(d_k) / q_k(d_k)); the first rejected one is replaced by a draw from
normalize(max(p_k - q_k, 0)) (p_k where that is all zero), and when every draft is kept the
bonus is drawn from p. Each committed token is then distributed exactly as the target's own
sampling would give it (Leviathan et al. 2023; tested by chi-square against the exact
distribution of a tiny target).

DFlash2 (DFLASH2.md 1.6): the same forward, then the candidate selector's walk from x over each
slot's top-k head candidates (CandidateSelector.walk) replaces the per-slot argmax or draw; at
temperature > 0 its q rows (zero off the candidates) are what the rejection sampling divides by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flashdraft.config import MIN_TEMPERATURE
from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel, check_rewind, mark_cache, rewind_cache


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), eos included if produced
    accepted: list[int] = field(default_factory=list)  # per step: drafts accepted (0 .. bs-1)
    seconds: float = 0.0
    # Drafts the last step accepted past eos / max_new_tokens, trimmed from accepted[-1] (tau is
    # tokens output per verification); the serving engines count them (engine_accepted).
    trimmed: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verification (accepted + 1)."""
        return float(np.mean(self.accepted) + 1) if self.accepted else float("nan")

    @property
    def engine_accepted(self) -> list[int]:
        """The per-step acceptances as vLLM's scheduler counts them: the last step's drafts
        accepted past eos / the token limit included."""
        return self.accepted[:-1] + [self.accepted[-1] + self.trimmed] if self.accepted else []


def tau_per_prompt(accepted: list[list[int]]) -> float:
    """The papers' tau (docs/evaluation.md): each prompt's mean tokens per verification step
    (accepted + 1), averaged over the prompts (a prompt with no step has no tau)."""
    means = [np.mean(steps) + 1 for steps in accepted if len(steps)]
    return float(np.mean(means)) if means else float("nan")


def tau_pooled(accepted: list[list[int]]) -> float:
    """The engines' tau (vLLM's and SGLang's mean acceptance length, docs/evaluation.md): every
    step of every prompt pooled, 1 + accepted drafts / verification steps."""
    steps = [a for prompt in accepted for a in prompt]
    return float(1 + np.sum(steps) / len(steps)) if steps else float("nan")


@dataclass(frozen=True)
class Sampling:
    """How the target samples: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise ValueError(f"--temperature {self.temperature}: use 0 (greedy) or a finite temperature of at least "
                             f"{MIN_TEMPERATURE:g} (below it logits / T overflow; 0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: use a value in (0, 1] (1: off)")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: use 0 (off) or a positive count")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's next-token distribution [..., V] (float32): logits / T, then top-k,
        then top-p (the smallest set of most likely tokens whose mass reaches top_p)."""
        z = logits.float() / self.temperature
        if 0 < self.top_k < z.shape[-1]:
            kth = z.topk(self.top_k, dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1:
            probs, order = z.softmax(-1).sort(-1, descending=True)
            drop = mass_before(probs) >= self.top_p  # the mass before a token already reaches top_p
            z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return z.softmax(-1)

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's proposal distribution: temperature only (top-k / top-p belong to the
        target's side, as in the reference and the serving engines)."""
        return (logits.float() / self.temperature).softmax(-1)


GREEDY = Sampling()


def mass_before(probs: torch.Tensor) -> torch.Tensor:
    """The probability mass before each entry along the last axis [..., V] (an exclusive prefix
    sum, float64), summed in 2^-53 fixed point: an integer cumsum is deterministic on every
    device, a float one raises on CUDA under torch.use_deterministic_algorithms. Each entry is
    rounded by at most 2^-54, so the sums are within V * 2^-54 of exact (fp32 cumsum: ~1e-7)."""
    fixed = (probs.double() * 2.0**53).round().long()
    return (fixed.cumsum(-1) - fixed).double() * 2.0**-53


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _verify(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, sampling: Sampling,
            generator: torch.Generator | None) -> tuple[int, int]:
    """(drafts accepted, the target's token after them) from the verify forward's ``logits``
    [n + 1, V] (row i: the target's next token after x, d1 .. di). ``q`` [n, V] is the
    distribution each draft was drawn from (None: the drafts are deterministic, q one-hot)."""
    if sampling.greedy:
        predicted = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
            accepted += 1
        return accepted, predicted[accepted]
    p = sampling.target_probs(logits)
    n = len(drafts)
    if n:
        rows, d = torch.arange(n, device=p.device), torch.tensor(drafts, device=p.device)
        q_d = q[rows, d].float() if q is not None else torch.ones(n, device=p.device)
        u = torch.rand(n, generator=generator, device=p.device)
        keep = u * q_d < p[rows, d]  # each draft kept with probability min(1, p / q)
        k = int(keep.long().cumprod(0).sum())  # the drafts kept before the first rejection
        if k < n:
            if q is not None:
                residual = (p[k] - q[k].float()).clamp_(min=0)
            else:  # a deterministic draft: q is one-hot at it
                residual = p[k].clone().index_fill_(0, d[k:k + 1], 0)
            return k, _draw(residual if float(residual.sum()) > 0 else p[k], generator)
    return n, _draw(p[n], generator)


def _first_token(logits: torch.Tensor, sampling: Sampling, generator) -> int:
    return int(logits.argmax()) if sampling.greedy else _draw(sampling.target_probs(logits), generator)


def _generator(device, sampling: Sampling) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed)
    return generator


def _stop_index(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> int:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos_ids:
            return i + 1
    return min(len(tokens), max_new_tokens)


@torch.no_grad()
def target_generate(target: TargetModel, prompt: list[int], max_new_tokens: int, eos_ids=(),
                    sampling: Sampling = GREEDY) -> Generation:
    """Plain decoding with the target's KV cache, one token per forward: greedy (the
    losslessness reference) or sampled (the speed reference at temperature > 0)."""
    eos_ids = set(eos_ids)
    generator = _generator(target.device, sampling)
    begin = time.perf_counter()
    cache = target.new_cache()
    ids = torch.tensor([prompt], device=target.device)
    logits, _ = target.forward_with_cache(ids, cache, 0)
    out = [_first_token(logits[0, -1], sampling, generator)]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        step = torch.tensor([[out[-1]]], device=target.device)
        logits, _ = target.forward_with_cache(step, cache, len(prompt) + len(out) - 1)
        out.append(_first_token(logits[0, -1], sampling, generator))
    return Generation(out, seconds=time.perf_counter() - begin)


def greedy_generate(target: TargetModel, prompt: list[int], max_new_tokens: int, eos_ids=()) -> Generation:
    """Plain greedy decoding with the target's KV cache: the losslessness reference."""
    return target_generate(target, prompt, max_new_tokens, eos_ids)


def _draft_and_verify(target: TargetModel, prompt: list[int], max_new_tokens: int, eos_ids, propose,
                      on_verified=None, sampling: Sampling = GREEDY) -> Generation:
    """The verification loop shared by every drafter.

    ``propose(x, tokens, generator)`` returns the drafts that should follow the last committed
    token x (``tokens``: prompt + output so far) and the distribution [n, V] each was drawn
    from (None when they are deterministic). ``on_verified(taps, accepted)`` receives the
    prefill taps (accepted None), then after each step the taps of x, d1..da (DFlash's context).
    """
    check_rewind(target)  # once per target: a rewind that is not exact stops here, before any verdict
    eos_ids = set(eos_ids)
    device = target.device
    generator = _generator(device, sampling)
    begin = time.perf_counter()
    cache = target.new_cache()
    logits, taps = target.forward_with_cache(torch.tensor([prompt], device=device), cache, 0)
    if on_verified:
        on_verified(taps, None)
    x = _first_token(logits[0, -1], sampling, generator)
    out, accepted_log = [x], []
    start = len(prompt)  # position of x
    while len(out) < max_new_tokens and x not in eos_ids:
        drafts, q = propose(x, prompt + out, generator)
        mark = mark_cache(cache)
        logits, taps = target.forward_with_cache(torch.tensor([[x] + drafts], device=device), cache, start)
        # logits[0, i]: the target's next token after x, d1 .. di (position start + i + 1)
        accepted, own = _verify(logits[0], drafts, q, sampling, generator)
        committed = drafts[:accepted] + [own]  # the accepted drafts + the target's own token
        out.extend(committed)
        accepted_log.append(accepted)
        rewind_cache(target, cache, mark, [x] + drafts[:accepted])  # keep x, d1..da
        if on_verified:
            on_verified(taps[:, : accepted + 1], accepted)
        start += accepted + 1
        x = out[-1]
        if any(t in eos_ids for t in committed):
            break
    stop, trimmed = _stop_index(out, eos_ids, max_new_tokens), 0
    if accepted_log and stop < len(out):
        # The last step crossed eos or max_new_tokens: count only the tokens it added that are
        # kept (at least the first), as tau is tokens output per verification.
        trimmed = min(len(out) - stop, accepted_log[-1])
        accepted_log[-1] -= len(out) - stop
    return Generation(out[:stop], accepted_log, time.perf_counter() - begin, trimmed)


@torch.no_grad()
def speculative_generate(
    target: TargetModel, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int, eos_ids=(),
    sampling: Sampling = GREEDY,
) -> Generation:
    """DFlash speculative decoding of one prompt (batch 1), greedy or sampled (module doc)."""
    device = target.device
    context = drafter.new_cache()
    dtype = next(drafter.parameters()).dtype
    mask_ids = torch.full((1, drafter.block_size - 1), drafter.mask_token_id, device=device)

    def propose(x: int, tokens: list[int], generator) -> tuple[list[int], torch.Tensor | None]:
        # One drafter forward over [x, MASK...] at positions start .. start + bs - 1.
        block = torch.cat([torch.tensor([[x]], device=device), mask_ids], dim=1)
        hidden = drafter.forward_block(context, target.embed(block).to(dtype))
        logits = target.lm_head(hidden[:, 1:].to(target.dtype))[0]
        if drafter.candidate_selector is not None:  # DFlash2: the selector's walk over each slot's candidates
            return drafter.candidate_selector.walk(hidden[0, 1:], logits, x, sampling.temperature, generator)
        if sampling.greedy:
            return logits.argmax(-1).tolist(), None
        q = sampling.draft_probs(logits)
        return torch.multinomial(q, 1, generator=generator).squeeze(1).tolist(), q

    def extend(taps: torch.Tensor, accepted: int | None) -> None:
        drafter.extend_context(context, taps.to(dtype))  # verified rows become drafter context

    return _draft_and_verify(target, prompt, max_new_tokens, eos_ids, propose, extend, sampling)


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
    target: TargetModel, prompt: list[int], max_new_tokens: int, block_size: int, eos_ids=(), max_ngram: int = 3,
    sampling: Sampling = GREEDY,
) -> Generation:
    """The no-model baseline: n-gram drafts of block_size - 1 tokens (deterministic: q is
    one-hot), verified like DFlash."""
    return _draft_and_verify(target, prompt, max_new_tokens, eos_ids,
                             lambda x, tokens, generator: (ngram_draft(tokens, block_size - 1, max_ngram), None),
                             sampling=sampling)
