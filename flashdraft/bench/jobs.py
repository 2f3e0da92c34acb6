"""The tiny training jobs the benchmarks share, and the trainer runs they time.

A job is a directory: ``target/`` (a random-weight causal LM built by ``flashdraft.toy``),
``data/`` (a token shard of random ids: these jobs measure speed and resource use, not
quality) and optionally ``heldout/`` and ``prompts.jsonl`` for evals. ``tiny_job`` serves
`bench train` and `bench pipeline`, ``gpu_job`` `bench gpu-pipeline`, ``soak_job`` `bench soak`.
``StepClock`` is the per-step hook the benchmarks time the trainer's steps with.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from flashdraft.toy import tiny_causal_lm


def write_job(root: Path, model, *, samples: int, length: int, prompt_length: int, max_id: int, seed: int = 0,
              heldout: int = 0, eval_prompts: int = 0) -> Path:
    """``model`` saved as root/target, and ``samples`` random sequences of ``length`` ids in
    [0, max_id) as the token shard root/data, the first ``prompt_length`` tokens of each
    unsupervised (the prompt) and the rest supervised; then ``heldout`` more as root/heldout and
    ``eval_prompts`` random prompts of ``prompt_length`` ids as root/prompts.jsonl. One numpy
    generator seeded ``seed`` draws them all, in that order, so a job is reproducible."""
    from flashdraft.data.shards import write_token_shard

    vocab = model.config.vocab_size
    model.save_pretrained(root / "target")
    rng = np.random.default_rng(seed)
    mask = np.r_[np.zeros(prompt_length), np.ones(length - prompt_length)]

    def shard(name: str, count: int) -> None:
        rows = [(rng.integers(0, max_id, length), mask) for _ in range(count)]
        write_token_shard(root / name, rows, vocab_size=vocab)

    shard("data", samples)
    if heldout:
        shard("heldout", heldout)
    if eval_prompts:
        from flashdraft.evaluate import write_prompts

        write_prompts(root / "prompts.jsonl", rng.integers(0, max_id, (eval_prompts, prompt_length)).tolist())
    return root


def tiny_job(root: Path, *, layers: int = 8, hidden: int = 256, samples: int = 64, length: int = 256) -> Path:
    """A random Qwen3-shaped target (vocab 1024, 8 query / 4 KV heads, MLP 3 * hidden) and a token
    dataset (random tokens: speed only, not quality), a quarter of each sample unsupervised."""
    model = tiny_causal_lm(1024, "qwen3", num_layers=layers, hidden=hidden, num_heads=8, num_kv_heads=4,
                           intermediate=3 * hidden, max_position_embeddings=4096, seed=0)
    return write_job(root, model, samples=samples, length=length, prompt_length=length // 4, max_id=1000)


def tiny_job_taps(layers: int) -> list[int]:
    """The 4 layers the tiny job's drafter taps, spread to the top: 8 layers [1, 3, 5, 7], 4
    [0, 1, 2, 3] (DFlash's own spread repeats layers on targets this shallow)."""
    if layers < 4:
        raise SystemExit(f"a {layers}-layer tiny target: it needs 4 or more layers (the drafter taps 4 of them)")
    return [round((i + 1) * layers / 4) - 1 for i in range(4)]


def gpu_job(root: Path, layers: int, samples: int, length: int, vocab: int = 151936, hidden: int = 1024) -> Path:
    """A random-weight Qwen3-0.6B-shaped target in bf16 (at the defaults and 28 layers: vocab
    151936, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072) and a token dataset of random
    ids, a quarter of each sample unsupervised."""
    model = tiny_causal_lm(vocab, "qwen3", num_layers=layers, hidden=hidden, num_heads=hidden // 64,
                           num_kv_heads=hidden // 128, head_dim=128, intermediate=3 * hidden,
                           max_position_embeddings=40960, seed=0, dtype=torch.bfloat16)
    return write_job(root, model, samples=samples, length=length, prompt_length=length // 4, max_id=vocab - 2)


def soak_job(root: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 target and random tokenized conversations (prompt 6 tokens, 34 supervised):
    64 to train on, 8 held out, and 4 eval prompts."""
    model = tiny_causal_lm(300, "qwen3", num_layers=4, hidden=32, max_position_embeddings=512, seed=seed)
    return write_job(root, model, samples=64, length=40, prompt_length=6, max_id=298, seed=seed, heldout=8,
                     eval_prompts=4)


def trainer_for(overrides: dict):
    """A Trainer on the config ``overrides`` (key -> value), not started."""
    from flashdraft.config import load_config
    from flashdraft.train.trainer import Trainer

    return Trainer(load_config(overrides=[f"{k}={v}" for k, v in overrides.items()]))


class StepClock:
    """A ``Trainer.fit(on_step=...)`` hook: the end time (``time.perf_counter()``) of every
    optimizer step, for steps/s."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, trainer) -> None:
        self.stamps.append(time.perf_counter())

    def steady_rate(self, skip: int) -> float:
        """Steps per second over the steps after the first ``skip`` (warm-up: allocator,
        first-call overheads)."""
        return (len(self.stamps) - 1 - skip) / (self.stamps[-1] - self.stamps[skip])


def real_run(job: Path, out: Path, *, steps: int, enabled: bool, threads: int, capacity: int,
             feature_cache_bytes: int = 0, keep_freed_host_memory: bool = True) -> dict:
    """The real trainer on ``job`` (made by ``tiny_job``) on CPU: a 1-layer drafter, blocks of 8,
    32 anchors, 2048-token batches, pipelined or not; steps/s, target tokens/s, the stage
    report, and steps/s within each epoch."""
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    taps = tiny_job_taps(AutoConfig.from_pretrained(job / "target").num_hidden_layers)
    overrides = {
        "target.path": job / "target", "drafter.mask_token_id": 1023, "drafter.num_layers": 1,
        "drafter.block_size": 8, "target.layer_ids": json.dumps(taps), "data.path": job / "data",
        "data.token_budget": 2048, "data.max_batch_size": 8, "objective.num_anchors": 32,
        "train.max_steps": steps, "train.log_every": steps, "checkpoint.save_every": 0, "train.output_dir": out,
        "train.device": "cpu", "train.metrics": "[jsonl]", "pipeline.enabled": str(enabled).lower(),
        "pipeline.capacity": capacity, "checkpoint.resume": "never",
        "pipeline.feature_cache_bytes": feature_cache_bytes,
        "train.keep_freed_host_memory": str(keep_freed_host_memory).lower(),
    }
    trainer, clock = trainer_for(overrides), StepClock()
    trainer.fit(on_step=clock)
    stamps, rate = clock.stamps, clock.steady_rate(min(3, steps // 3))
    tokens = int(trainer.dataset.lengths.sum()) / trainer.sampler.batches_per_epoch  # mean tokens per step
    per_epoch = trainer.sampler.batches_per_epoch
    epochs = [stamps[e : e + per_epoch] for e in range(0, len(stamps), per_epoch)]
    epoch_rates = [(len(t) - 1) / (t[-1] - t[0]) for t in epochs if len(t) > 1]  # each epoch's own steps
    return {"steps_per_s": rate, "tokens_per_s": rate * tokens, "report": trainer.pipeline_report,
            "epoch_steps_per_s": epoch_rates, "steps_per_epoch": per_epoch}
