"""The drafter's modules: DFlashDrafter, its layers, and the context cache for decoding.

Architecture (DFLASH.md): Qwen3-style pre-norm decoder layers whose keys/values are
``[proj(ctx) ; proj(block)]`` ("KV injection": same k_proj / v_proj / k_norm for both parts,
RoPE on all keys and on the queries), where ``ctx = hidden_norm(fc(concat(taps)))`` is fused
once per forward and never updated between layers. Queries come only from the block. The
drafter owns no embedding and no LM head: callers embed block tokens with the target's
``embed`` and score ``norm(h)`` with the target's ``lm_head``.

The training attention lives in flashdraft.drafter.attention, the custom-backward kernels in
flashdraft.drafter.kernels, the serving config and export files in flashdraft.drafter.serving.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from flashdraft.config import ATTENTION_IMPLS
from flashdraft.drafter import serving
from flashdraft.drafter.attention import (
    EXTRA_IMPLS,
    BlockAttentionPlan,
    attend,
    attention_plan,
    decode_mask,
    resolve_attention,
)
from flashdraft.drafter.dflash2 import CandidateSelector, GroupedDynamicConv
from flashdraft.drafter.kernels import RMSNorm, RotaryEmbedding, apply_rope, swiglu, use_lean
from flashdraft.drafter.serving import drafter_config_from_target


class DrafterAttention(nn.Module):
    lean = True  # training RoPE written into one tensor (apply_rope); False: transformers' expression

    def __init__(self, config: Qwen3Config, sink: bool = False):
        """``sink``: a learnable per-head attention sink logit (``attention_sink_bias`` [heads],
        the serving engines' name), starting at 0."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if sink else None

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, Hkv, T, D], k normed and rotated. With ``index`` [T'], x holds
        distinct rows and row t is x[:, index[t]]: projected and normed once, rotated per row."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if index is not None:
            k, v = k[:, index], v[:, index]
        return apply_rope(k.transpose(1, 2), cos, sin, use_lean(self, x)), v.transpose(1, 2)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))
        if index is not None:
            q = q[:, index]
        return apply_rope(q.transpose(1, 2), cos, sin, use_lean(self, x))

    def forward(self, x, rope, ctx_kv, mask=None, rows=None, index=None) -> torch.Tensor:
        """x [B, Q, H] block stream; ctx_kv: context k, v [B, Hkv, S, D].

        ``mask``: None (inference: every key visible), a bool [B, 1, Q, S + Q] mask, or a
        BlockAttentionPlan (training: dense / split / blockwise / flex, all the same function).
        ``rows``: a function of a [B, Q, ...] tensor returning the rows to output (None: all);
        every row still serves as a key. ``index`` [Q]: x holds the stream's distinct rows and
        row t is x[:, index[t]] (see keys_values).
        """
        cos, sin = rope
        q = self.queries(x, cos, sin, index)
        k_blk, v_blk = self.keys_values(x, cos, sin, index)
        plan = mask if isinstance(mask, BlockAttentionPlan) else BlockAttentionPlan("dense", mask=mask)
        return self._project(attend(q, k_blk, v_blk, ctx_kv[0], ctx_kv[1], plan, self.attention_sink_bias), rows)

    def _project(self, out: torch.Tensor, rows=None) -> torch.Tensor:
        b = out.shape[0]
        out = out.transpose(1, 2)
        if rows is not None:
            out = rows(out)
        return self.o_proj(out.reshape(b, -1, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    lean = True  # training MLP through _SwiGLU; False: Qwen3MLP under autograd

    def __init__(self, config: Qwen3Config, conv: tuple[int, int, int] | None = None, sink: bool = False):
        """``conv``: DFlash2's (kernel size, group size, block size): a GroupedDynamicConv around the
        attention (``attention_conv``) and around the MLP (``mlp_conv``); None: DFlash's layer.
        ``sink``: an attention sink in the attention (DrafterAttention)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, sink)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.swiglu = config.hidden_act == "silu"  # Qwen3MLP: bias-free gate / up / down
        self.attention_conv = self.mlp_conv = None
        if conv is not None:
            self.attention_conv = GroupedDynamicConv(config.hidden_size, *conv)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, *conv)

    def forward(self, x, rope, ctx_kv, mask=None, rows=None, distinct=None) -> torch.Tensor:
        """``rows``: output only these rows of the block stream (DrafterAttention.forward).
        ``distinct``: (x's distinct rows [B, U, H], index [Q]) with x = distinct rows[:, index]:
        the input norm and the q / k / v projections run on the U distinct rows only. Neither
        applies to a DFlash2 layer, whose convolutions mix each row with the slots before it."""
        if self.attention_conv is not None:
            return self._convolved(x, rope, ctx_kv, mask)
        if distinct is None:
            attn = self.self_attn(self.input_layernorm(x), rope, ctx_kv, mask, rows)
        else:
            attn = self.self_attn(self.input_layernorm(distinct[0]), rope, ctx_kv, mask, rows, distinct[1])
        x = (x if rows is None else rows(x)) + attn
        return x + self._mlp(self.post_attention_layernorm(x))

    def _convolved(self, x, rope, ctx_kv, mask) -> torch.Tensor:
        """DFlash2's layer (DFLASH2.md 1.2): each sublayer runs on its convolved normalised input,
        its output is convolved again before the residual add, and both kernels come from that
        normalised input. The context K/V (``ctx_kv``) are never convolved."""
        h = self.input_layernorm(x)
        delta = self.attention_conv.kernels(h)
        attn = self.self_attn(self.attention_conv(h, delta, 0), rope, ctx_kv, mask)
        x = x + self.attention_conv(attn, delta, 1)
        h = self.post_attention_layernorm(x)
        delta = self.mlp_conv.kernels(h)
        return x + self.mlp_conv(self._mlp(self.mlp_conv(h, delta, 0)), delta, 1)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu and use_lean(self, h):  # the memory-lean MLP (same values)
            mlp = self.mlp
            return swiglu(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        return self.mlp(h)


@dataclass
class ContextCache:
    """Per-layer context keys/values [B, Hkv, T, D] for decoding; holds CONTEXT rows only."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def crop(self, length: int) -> None:
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class DFlashDrafter(nn.Module):
    """The DFlash drafter. ``config`` is the serving config.json dict."""

    def __init__(self, config: dict, *, attention: str = "auto", group_blocks: int = 0,
                 activation_checkpointing: bool = False, lean: bool = True):
        """``attention``: training-attention implementation (see attention.resolve_attention);
        ``group_blocks``: blocks per group for "split" (0: auto, N / 8) and "blockwise" (0: auto,
        64 query rows);
        ``activation_checkpointing``: recompute each layer in backward (training forward only);
        ``lean``: the custom-backward RMSNorm / RoPE / SwiGLU in training, with or without autocast
        (False: transformers' stock modules under autograd, same values: the oracle's way; see
        set_lean). Inference always runs the stock modules.
        None of these touch the weights or the serving config."""
        super().__init__()
        if attention not in ATTENTION_IMPLS and attention not in EXTRA_IMPLS:
            raise ValueError(f"attention={attention!r} unknown: use one of {', '.join(ATTENTION_IMPLS)}")
        self.attention = attention
        self.group_blocks = int(group_blocks)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.config = dict(config)
        qcfg = serving.qwen3_config(self.config)
        # dflash_config first (the reference's and SGLang's order); older exports keep it top-level only
        self.block_size = int(self.config["dflash_config"].get("block_size") or self.config["block_size"])
        self.mask_token_id = int(self.config["dflash_config"]["mask_token_id"])
        self.target_layer_ids = list(self.config["dflash_config"]["target_layer_ids"])
        self.layer_masks = serving.layer_attention(self.config)  # each layer's window and in-block causality
        modules = serving.dflash2_modules(self.config)  # DFlash2: the conv's and the selector's sizes
        hidden = qcfg.hidden_size
        conv = (modules.conv_kernel_size, modules.conv_group_size, self.block_size) if modules else None
        self.sinks = serving.attention_sinks(self.config)  # an attention sink in every layer
        self.layers = nn.ModuleList(DrafterLayer(qcfg, conv, self.sinks) for _ in range(qcfg.num_hidden_layers))
        self.norm = RMSNorm(hidden, eps=qcfg.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps=qcfg.rms_norm_eps)
        self.candidate_selector = (CandidateSelector(hidden, qcfg.vocab_size, modules.selector_rank,
                                                     modules.selector_top_k) if modules else None)
        self.rotary_emb = RotaryEmbedding(qcfg)  # non-persistent fp32 buffers: never saved, never cast
        self.set_lean(lean)

    def set_lean(self, lean: bool) -> None:
        """Switch the training-time RMSNorm / RoPE / SwiGLU between the lean custom-backward
        versions and transformers' stock modules (same values; tests/test_step_equivalence.py)."""
        for module in self.modules():
            if isinstance(module, RMSNorm | DrafterAttention | DrafterLayer):
                module.lean = bool(lean)

    @property
    def convolved(self) -> bool:
        """DFlash2's layers: each sublayer wrapped in a GroupedDynamicConv."""
        return self.layers[0].attention_conv is not None

    @classmethod
    def for_target(cls, target, *, num_layers: int, block_size: int, mask_token_id: int,
                   layer_types=None, sliding_window: int | None = None, causal: bool | None = None,
                   dflash2: serving.DFlash2Modules | None = None, sinks: bool = False, **kwargs) -> DFlashDrafter:
        """``layer_types`` / ``sliding_window`` / ``causal``: the layers' attention, ``dflash2``
        DFlash2's conv and selector sizes (see serving.drafter_config_from_target; default: DFlash
        v1's full bidirectional layers), ``sinks`` an attention sink in every layer; ``kwargs``:
        the training-time switches of ``__init__`` (attention, group_blocks, ...)."""
        cfg = drafter_config_from_target(
            target.config, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id,
            target_layer_ids=target.layer_ids, layer_types=layer_types, sliding_window=sliding_window, causal=causal,
            dflash2=dflash2, sinks=sinks,
        )
        return cls(cfg, **kwargs)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """The published recipe's init: normal(0, std) linears, ones for norms; DFlash2's conv as
        the identity and its selector as a no-op (the trainers' start: a fresh DFlash2 drafts what
        its DFlash backbone drafts)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():  # after the loop above, which re-drew their linears
            if isinstance(module, GroupedDynamicConv):
                module.reset_parameters()
            elif isinstance(module, CandidateSelector):
                module.reset_parameters(std, generator)
            elif isinstance(module, DrafterAttention) and module.attention_sink_bias is not None:
                nn.init.zeros_(module.attention_sink_bias)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] for integer positions [B, T]."""
        return self.rotary_emb(like, positions)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Packed taps [B, S, K*H] -> context [B, S, H] (once per forward)."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys/values for fused context [B, S, H] at positions [B, S]."""
        cos, sin = self.rope(positions, ctx)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        valid: torch.Tensor,
        attention: str | None = None,
        scored_only: bool = False,
        mask_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training forward over many anchored blocks of each sequence in one pass.

        features [B, S, K*H] target taps; block_embeds [B, N, bs, H] the target-embedded block
        tokens; anchors [B, N] positions, sorted ascending among the valid ones (sample_anchors
        does); valid [B, N] bool (padded blocks: False). ``attention`` overrides
        ``self.attention`` for this call ("dense" is the oracle). Returns norm(h) [B, N, bs, H],
        ready for the target's LM head. Equals, block by block, ``forward_block`` with
        context = features[:, :anchor] (tested), whatever the implementation.

        ``scored_only``: return slots 1..bs-1 only, [B, N, bs - 1, H]. Slot 0 (the anchor) is
        never scored, so the last layer skips its output projection, MLP and final norm (slot 0
        still serves as a key to the others): ~1/bs of the last layer and of the LM head saved.

        ``mask_embed`` [H]: the blocks are DFlash's [anchor token, MASK, ..., MASK]; then
        block_embeds is [B, N, H], the anchor tokens' embeddings only. Layer 0's input norm and
        q / k / v projections run on the N + 1 distinct rows (every MASK row is the same vector
        before RoPE) instead of N * bs: same result, ~(bs - 1) / bs of that work saved.

        DFlash2's convolutions mix each slot with the ones before it, so its layers compute
        every row: ``scored_only`` then drops slot 0 before the final norm only, and with
        ``mask_embed`` layer 0 gets the expanded rows.

        Each layer's context K/V is computed once per sequence; a valid block anchored at a
        attends context j < a and its own bs slots, a padded block only its own slots.
        """
        b, s, _ = features.shape
        distinct = None
        convolved = self.convolved  # DFlash2: every row of every layer (see DrafterLayer.forward)
        if mask_embed is None:
            _, n, bs, hidden = block_embeds.shape
            x = block_embeds.reshape(b, n * bs, hidden)
        else:
            if block_embeds.dim() != 3:
                raise ValueError(f"with mask_embed, block_embeds holds the anchors' embeddings [B, N, H], not "
                                 f"{tuple(block_embeds.shape)}")
            (_, n, hidden), bs = block_embeds.shape, self.block_size
            distinct_rows = torch.cat([block_embeds, mask_embed.view(1, 1, hidden).expand(b, 1, hidden)], dim=1)
            index = torch.full((n, bs), n, device=anchors.device)  # row n: the MASK embedding
            index[:, 0] = torch.arange(n, device=anchors.device)
            index = index.flatten()
            distinct, x = (distinct_rows, index), distinct_rows[:, index]
        ctx = self.fuse(features)
        ctx_kv = self.context_kv(ctx, torch.arange(s, device=features.device).expand(b, s))
        positions = (anchors.unsqueeze(-1) + torch.arange(bs, device=anchors.device)).flatten(1)
        rope = self.rope(positions, x)
        plans = {layer: self.attention_plan(anchors, valid, s, attention, needs_grad=torch.is_grad_enabled(),
                                            dtype=x.dtype, layer=layer) for layer in set(self.layer_masks)}
        last = len(self.layers) - 1

        def scored_rows(t: torch.Tensor) -> torch.Tensor:  # rows [B, N*bs, ...] -> slots 1.. [B, N*(bs-1), ...]
            return t.unflatten(1, (n, bs))[:, :, 1:].flatten(1, 2)

        # The last layer keeps its attention probabilities (blockwise): its backward comes first,
        # right after the head. The peak is at the start of the backward, so keeping them in
        # every layer would add every layer's probabilities to it, for the same saving per layer.
        for i, (layer, kv) in enumerate(zip(self.layers, ctx_kv)):
            select = scored_rows if scored_only and i == last and not convolved else None
            plan = plans[self.layer_masks[i]]
            args = (x, rope, kv, replace(plan, keep_probs=True) if i == last else plan, select,
                    distinct if i == 0 and not convolved else None)
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        if scored_only and convolved:
            x = scored_rows(x)
        return self.norm(x).view(b, n, bs - int(scored_only), hidden)

    def attention_plan(
        self, anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, attention: str | None = None,
        needs_grad: bool = True, dtype: torch.dtype = torch.float32, layer=None,
    ) -> BlockAttentionPlan:
        """The masks the layers of one training forward with the pattern ``layer`` (a LayerMask;
        None: the first layer's) share (see BlockAttentionPlan), for this drafter's block size
        and group_blocks; ``attention`` overrides ``self.attention``. With attention sinks, "auto"
        resolves to blockwise on CUDA and "flex" is refused (resolve_attention)."""
        impl = resolve_attention(attention or self.attention, anchors.device, needs_grad, self.sinks)
        return attention_plan(impl, anchors, valid, seq_len, self.block_size,
                              self.group_blocks, needs_grad, dtype, layer or self.layer_masks[0])

    # ---- decoding -------------------------------------------------------------------------

    def new_cache(self) -> ContextCache:
        return ContextCache([], [])

    def extend_context(self, cache: ContextCache, features: torch.Tensor) -> None:
        """Append context rows (taps [B, T, K*H] of the next T positions) to the cache."""
        b, t, _ = features.shape
        start = cache.length
        positions = torch.arange(start, start + t, device=features.device).expand(b, t)
        kvs = self.context_kv(self.fuse(features), positions)
        if not cache.keys:
            cache.keys = [k for k, _ in kvs]
            cache.values = [v for _, v in kvs]
        else:
            cache.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(cache.keys, kvs)]
            cache.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(cache.values, kvs)]

    def forward_block(self, cache: ContextCache, block_embeds: torch.Tensor) -> torch.Tensor:
        """Inference forward of one block [B, bs, H] placed right after the cached context.

        The block sees the cached context rows and itself as each layer's pattern allows (DFlash
        v1: all of them, bidirectionally); its own rows are never added to the cache (the crop
        back to ``start`` of DFLASH.md is implicit).
        """
        b, t, _ = block_embeds.shape
        start = cache.length
        positions = torch.arange(start, start + t, device=block_embeds.device).expand(b, t)
        rope = self.rope(positions, block_embeds)
        masks = {layer: decode_mask(start, t, layer, block_embeds.device) for layer in set(self.layer_masks)}
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, (cache.keys[i], cache.values[i]), masks[self.layer_masks[i]])
        return self.norm(x)

    # ---- serving format -------------------------------------------------------------------

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write config.json + model.safetensors (no embedding, no LM head, no rotary buffers).
        Each file is written beside its final name and renamed onto it: a crash mid-export leaves
        the previous export's file, never a torn one (serving.write_export)."""
        config = dict(self.config, dtype=str(dtype).removeprefix("torch."))
        # what a loader would misread (a layout or size the engines' rules resolve otherwise) is
        # refused before anything is written
        serving.check_supported(config, f"{path} (the drafter being saved)")
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        return serving.write_export(path, state, config)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> DFlashDrafter:
        """Load an export written by save_pretrained (or another DFlash trainer's, if its layers
        are the ones implemented here: serving.check_supported), cast to ``dtype`` on ``device``."""
        path = Path(path)
        config = serving.read_config(path)
        with torch.device("meta"):  # the shapes config.json implies, allocating nothing
            expected = {name: tuple(t.shape) for name, t in cls(config).state_dict().items()}
        found = serving.weight_shapes(path)  # the file's header: compared before any weight is allocated
        missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        if missing or unexpected:
            raise ValueError(f"{path}/model.safetensors: missing weights {missing}, unexpected weights {unexpected}")
        other = next((name for name in expected if expected[name] != found[name]), None)
        if other is not None:  # a tampered or mixed export
            raise ValueError(f"{path}/model.safetensors does not fit its config.json (size mismatch for {other}: "
                             f"{list(found[other])} in the file, {list(expected[other])} from config.json); export the "
                             "drafter again (flashdraft export) rather than editing either file")
        model = cls(config)
        model.load_state_dict(serving.read_weights(path))
        return model.to(device=device, dtype=dtype)
