"""The toy builders: real BPE tokenizers with real chat templates, tiny HF models."""

import pytest
from transformers import AutoTokenizer

from flashdraft.toy import MASK_TOKEN, causal_lm_config, synthetic_conversations, tiny_causal_lm, train_toy_tokenizer

STYLES = ["qwen3", "llama3", "generation"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!"}]


@pytest.mark.parametrize("style", STYLES)
def test_tokenizer_roundtrips_through_save_pretrained(style, tmp_path):
    tok = train_toy_tokenizer(template=style)
    assert tok.is_fast and tok.eos_token and tok.pad_token
    assert tok.convert_tokens_to_ids(MASK_TOKEN) == len(tok) - 1
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert "Hello there!" in text and tok.eos_token in text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.apply_chat_template(CHAT, tokenize=False) == text
    assert again.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert again.decode(tok.encode("héllo wörld ✓", add_special_tokens=False)) == "héllo wörld ✓"


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_next"])
def test_tiny_model_covers_the_vocab(arch):
    tok = train_toy_tokenizer(template="qwen3")
    model = tiny_causal_lm(tok, arch=arch, num_layers=2)
    assert model.config.vocab_size == len(tok)
    assert model.get_input_embeddings().weight.shape[0] >= tok.convert_tokens_to_ids(MASK_TOKEN) + 1
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_config_fields_pass_through_and_the_weights_follow_the_seed():
    import torch

    cfg = causal_lm_config(300, num_layers=2, hidden=64, num_heads=2, head_dim=128, tie_word_embeddings=True)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size, cfg.tie_word_embeddings) == (300, 128, 128, True)
    hybrid = causal_lm_config(300, arch="qwen3_next", num_layers=6)
    assert hybrid.layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]
    a, b = tiny_causal_lm(300, num_layers=2, seed=7), tiny_causal_lm(300, num_layers=2, seed=7, dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16 and str(b.config.dtype).endswith("bfloat16") and not b.training
    assert all(torch.equal(x.to(torch.bfloat16), y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="unknown arch"):
        causal_lm_config(300, arch="gpt2")


def test_synthetic_conversations_are_deterministic():
    assert synthetic_conversations(5, seed=1) == synthetic_conversations(5, seed=1)
    sg = synthetic_conversations(3, shape="sharegpt")
    assert sg[0]["conversations"][-1]["from"] == "gpt"
