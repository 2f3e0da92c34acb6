"""Training with the vLLM target backend (target.backend=vllm): the same per-step losses as
the transformers backend, fp32, same seed, on samples of several lengths (padded batches), with the
start-up feature check on and the feature cache serving the engine's features from the second epoch
(20 steps: 8 per epoch). One engine start (the trainer's)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import overrides
from flashdraft.cli import main
from flashdraft.data.shards import write_token_shard
from flashdraft.target.engine import EngineError, EngineOptions, engine_interpreter
from flashdraft.toy import tiny_causal_lm

pytestmark = [pytest.mark.xdist_group("engine_target"), pytest.mark.slow]

STEPS = 20


def make_job(root: Path) -> int:
    """A 4-layer Qwen3 target (head_dim 32) and its greedy continuations of random 6-token prompts,
    cut to 24..40 tokens so that batches are padded; returns an id the data never holds (the MASK)."""
    model = tiny_causal_lm(300, arch="qwen3", num_layers=4, hidden=64, num_heads=2, num_kv_heads=1, seed=1,
                           max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with torch.no_grad():  # a confident head: random init gives near-uniform logits no drafter could match
        model.lm_head.weight.mul_(30)
    model.save_pretrained(root / "target")
    prompts = torch.randint(0, 298, (32, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=34, do_sample=False)
    lengths = (24 + torch.randint(0, 17, (32,), generator=torch.Generator().manual_seed(1))).tolist()
    mask = np.r_[np.zeros(6), np.ones(34)]
    write_token_shard(root / "data", [(row[:n].numpy(), mask[:n]) for row, n in zip(out, lengths)], vocab_size=300)
    return max(set(range(300)) - set(out.flatten().tolist()))


def losses(out: Path) -> list[float]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if "loss" in r]


def test_training_on_the_engines_features_gives_the_transformers_backends_losses(tmp_path, caplog):
    try:
        engine_interpreter(EngineOptions(), log_fn=print)
    except EngineError as exc:
        pytest.skip(str(exc))
    caplog.set_level(logging.INFO, logger="flashdraft.train.startup")
    mask_id = make_job(tmp_path)
    runs = {}
    for backend, cache in (("transformers", 0), ("vllm", int(1e8))):  # the engine's features cached from epoch 2 on
        out = tmp_path / backend
        assert main(["train", *overrides(tmp_path, out, train__max_steps=STEPS, target__backend=backend,
                                         drafter__mask_token_id=mask_id, pipeline__feature_cache_bytes=cache)]) == 0
        runs[backend] = losses(out)
    assert len(runs["vllm"]) == len(runs["transformers"]) == STEPS
    np.testing.assert_allclose(runs["vllm"], runs["transformers"], rtol=1e-4, atol=0)
    assert "the vLLM engine's features match the in-process forward on 4 samples" in caplog.text
    last = json.loads((tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["cache/hits"] > 0 and last["cache/skipped_forwards"] > 0  # later epochs trained on cached features
