"""The published recipe's pieces the trainer wires together: LR schedule, MASK id lookup,
gamma setting, defaults (DFLASH.md)."""

import math

import pytest

from flashdraft.config import load_config
from flashdraft.toy import train_toy_tokenizer
from flashdraft.train.checks import resolve_mask_token_id
from flashdraft.train.optim import warmup_cosine


def test_lr_warms_up_linearly_over_4_percent_then_follows_a_cosine_to_zero():
    f = warmup_cosine(1000, 0.04)
    assert [f(s) for s in (0, 19, 39)] == [1 / 40, 20 / 40, 1.0]  # 40 warmup steps, peak at the last one
    assert f(40) == 1.0 and f(1000) == pytest.approx(0.0, abs=1e-12)
    assert f(40 + 480) == pytest.approx(0.5)  # half-way through the decay
    assert all(f(s) >= f(s + 1) for s in range(40, 1000))  # monotone after warmup
    assert warmup_cosine(100, 0.0)(0) == 1.0  # no warmup: starts at the peak
    assert warmup_cosine(100, 0.0)(50) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))


def test_mask_id_comes_from_config_else_the_tokenizers_mask_token(tmp_path):
    tok = train_toy_tokenizer(vocab_size=300)
    tok.save_pretrained(tmp_path / "tok")
    assert resolve_mask_token_id(None, str(tmp_path / "tok")) == tok.get_vocab()["<|MASK|>"]
    assert resolve_mask_token_id(7, str(tmp_path / "tok")) == 7
    with pytest.raises(ValueError, match="no tokenizer to find the mask token in .*set drafter.mask_token_id"):
        resolve_mask_token_id(None, str(tmp_path / "nothing"))


def test_defaults_are_the_published_recipe():
    cfg = load_config(overrides=[])
    assert (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.objective.num_anchors) == (5, 16, 512)
    assert cfg.optim.lr == 6e-4 and cfg.optim.warmup_frac == 0.04 and cfg.optim.grad_clip == 1.0
    assert tuple(cfg.optim.betas) == (0.9, 0.999) and cfg.optim.weight_decay == 0.0 and cfg.optim.init_std == 0.02
    assert cfg.train.epochs == 6 and cfg.data.max_length == 3072
    assert cfg.objective.gamma == 0  # 0: the published default for the block size (7 at 16); null: no decay
