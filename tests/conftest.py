"""Shared fixtures: tiny real Hugging Face targets, built in well under a second."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel

VOCAB = 300
MASK_ID = VOCAB - 1


def tiny_qwen3(num_layers: int = 6, hidden: int = 64, seed: int = 0, **kw) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw,
    )
    return Qwen3ForCausalLM(cfg).eval()


def tiny_llama(num_layers: int = 4, hidden: int = 64, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def target() -> TargetModel:
    return TargetModel(tiny_qwen3(), [1, 3, 5])


def make_drafter(target: TargetModel, num_layers: int = 2, block_size: int = 8, seed: int = 0) -> DFlashDrafter:
    drafter = DFlashDrafter.for_target(target, num_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID)
    drafter.reset_parameters(std=0.02, generator=torch.Generator().manual_seed(seed))
    return drafter.eval()


@pytest.fixture
def drafter(target) -> DFlashDrafter:
    return make_drafter(target)
