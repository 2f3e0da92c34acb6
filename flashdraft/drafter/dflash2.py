"""DFlash2's two modules (DFLASH2.md section 1): the grouped dynamic convolution along a block's
slots and the low-rank candidate selector.

Both are written against the serving engines' tensors, by name and layout (vLLM
``qwen3_dflash2.py``, SGLang #35371, the z-lab reference): ``base_kernel`` [2, K, H] and
``kernel_projection.weight`` [2*K*G, H] with output order (side, tap, group);
``predecessor_codebook`` / ``successor_codebook`` [V, r] as raw parameters (no ``.weight``) and
``hidden_projection.weight`` [r, H]. Each starts as a no-op (identity conv, zero successor
codebook), so a fresh DFlash2 drafts exactly what its DFlash backbone drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.config import DrafterConfig


@dataclass(frozen=True)
class DFlash2Modules:
    """DFlash2's module sizes, the dflash_config keys vLLM requires of a DFlash2DraftModel (and
    SGLang reads in pairs): the conv's taps K and channels per group, the selector's rank and
    candidates per slot. The defaults are the released drafters' (DFLASH2.md 1.5)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @classmethod
    def of(cls, drafter: DrafterConfig) -> DFlash2Modules | None:
        """The sizes a run's ``drafter`` config sets (None: a DFlash drafter, which has neither module)."""
        if drafter.family != "dflash2":
            return None
        return cls(drafter.conv_kernel_size, drafter.conv_group_size, drafter.selector_rank, drafter.selector_top_k)


class GroupedDynamicConv(nn.Module):
    """The causal convolution along each block's slots, before ("prepare", side 0) and after
    ("finish", side 1) one sublayer: out[i, c] = sum_t (base[s, t, c] + delta[i, s, t, c // gs])
    * x[i - t, c], x[i - t] = 0 before the block's slot 0. ``delta`` comes from the sublayer's
    normalised input (``kernels``) and serves both sides; the taps never leave the block."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if not 1 <= kernel_size <= block_size:
            raise ValueError(f"conv_kernel_size={kernel_size}: use 1 .. block_size ({block_size}); the taps "
                             "stay inside a block")
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}")
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of both sides 1, every other tap 0, no dynamic part."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1
            self.kernel_projection.weight.zero_()

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """The dynamic kernels [B, L, 2, K, G] of the normalised sublayer input x [B, L, H]."""
        return self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))

    def forward(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x [B, N * bs, H] (whole blocks, slot-major inside each) -> the same shape."""
        b, length, hidden = x.shape
        bs, groups = self.block_size, self.groups
        blocks = x.view(b, length // bs, bs, groups, self.group_size)
        dynamic = delta[:, :, side].to(x.dtype).view(b, length // bs, bs, self.kernel_size, groups, 1)
        base = self.base_kernel[side].to(x.dtype).view(self.kernel_size, groups, self.group_size)
        out = torch.zeros_like(blocks)
        for t in range(self.kernel_size):
            shifted = blocks if t == 0 else F.pad(blocks[:, :, :-t], (0, 0, 0, 0, t, 0))  # slot i reads i - t
            # the reference's order, base term then dynamic term (bf16 rounding as served)
            out = torch.addcmul(out + base[t] * shifted, dynamic[:, :, :, t], shifted)
        return out.view(b, length, hidden)


class CandidateSelector(nn.Module):
    """Re-ranks the target head's top-``top_k`` tokens of each draft slot by the predecessor
    token: score(c | p) = u(c) + sum_r A[p, r] * P[r] * B[c, r], with u the unary (head) logit of
    candidate c, A / B the predecessor / successor codebooks and P = hidden_projection(h) of
    the slot's final-normed hidden h."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1:
            raise ValueError(f"selector_rank={rank}: use 1 or more (256 is the released drafters')")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k={top_k}: use 1 .. vocab_size ({vocab_size})")
        self.rank, self.top_k = rank, top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """SpecForge's / NeMo's start: A and the projection normal(0, std), B zero, so every score
        is the unary logit (the selector picks the head's argmax) and B is trained first."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=std, generator=generator)
            nn.init.normal_(self.hidden_projection.weight, std=std, generator=generator)
            self.successor_codebook.zero_()

    def scores(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor,
               unary: torch.Tensor) -> torch.Tensor:
        """Scores [R, Kc] of ``candidates`` [R, Kc] (ids) with unary logits ``unary`` [R, Kc] after
        the token ``previous`` [R] at slots whose final-normed hidden is ``hidden`` [R, H]."""
        gate = self.hidden_projection(hidden) * self.predecessor_codebook[previous].to(hidden.dtype)
        return unary + _PairScores.apply(gate, self.successor_codebook, candidates)

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """One block's drafts: the walk from the verified ``anchor`` token over slots 1 .. n,
        each slot choosing among its top-k candidates given the previous slot's choice; greedy
        (argmax, the lowest index on ties) or, at ``temperature`` > 0, sampled from q = softmax(
        score / T). ``hidden`` [n, H] final-normed, ``logits`` [n, V] the target head's. Returns
        the drafts and (sampled) each slot's q as a [n, V] distribution, zero off its candidates:
        the proposal the verifier's rejection sampling needs."""
        unary, candidates = logits.float().topk(self.top_k, dim=-1)
        projected = self.hidden_projection(hidden).float()
        previous, drafts, rows = anchor, [], []
        for k in range(candidates.shape[0]):
            gate = projected[k] * self.predecessor_codebook[previous].float()
            score = unary[k] + self.successor_codebook[candidates[k]].float() @ gate
            if temperature == 0:
                j = int(score.argmax())
            else:
                q = (score / temperature).softmax(-1)
                j = int(torch.multinomial(q, 1, generator=generator))
                rows.append(torch.zeros(logits.shape[-1], device=logits.device).index_copy_(0, candidates[k], q))
            previous = int(candidates[k, j])
            drafts.append(previous)
        return drafts, torch.stack(rows) if rows else None


class _PairScores(torch.autograd.Function):
    """<gate_r, B[c_rj]> [R, Kc] for gate [R, r], the successor codebook B [V, r] and candidates
    c [R, Kc], in chunks of rows: the gathered [rows, Kc, r] codebook rows exist one chunk at a
    time, in the forward and in the backward (d gate = sum_j g_rj B[c_rj], an embedding bag;
    d B[c_rj] += g_rj gate_r), instead of autograd keeping all of them (~235 MB per copy at 512
    anchors x 4 sequences x 7 slots x 16 candidates x rank 256)."""

    CHUNK = 4096  # rows per chunk

    @staticmethod
    def forward(ctx, gate, codebook, candidates):
        out = torch.empty(candidates.shape, dtype=gate.dtype, device=gate.device)
        for start in range(0, gate.shape[0], _PairScores.CHUNK):
            part = slice(start, start + _PairScores.CHUNK)
            rows = codebook[candidates[part]].to(gate.dtype)  # [chunk, Kc, r]
            out[part] = torch.bmm(rows, gate[part].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(gate, codebook, candidates)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, codebook, candidates = ctx.saved_tensors
        d_gate = d_book = None
        if ctx.needs_input_grad[0]:
            d_gate = F.embedding_bag(candidates, codebook.to(grad.dtype), per_sample_weights=grad,
                                     mode="sum").to(gate.dtype)
        if ctx.needs_input_grad[1]:
            d_book = torch.zeros_like(codebook)
            for start in range(0, gate.shape[0], _PairScores.CHUNK):
                part = slice(start, start + _PairScores.CHUNK)
                rows = grad[part].unsqueeze(-1) * gate[part].unsqueeze(1)  # [chunk, Kc, r]
                d_book.index_add_(0, candidates[part].flatten(), rows.flatten(0, 1).to(codebook.dtype))
        return d_gate, d_book, None
