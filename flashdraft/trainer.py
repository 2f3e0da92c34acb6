"""The online trainer: `flashdraft train`.

Each optimizer step: collate ``grad_accum`` micro-batches, draw their anchored blocks, agree on
the GLOBAL loss normaliser (one tiny all-reduce), then per micro-batch run the frozen target
up to its last tapped layer, the drafter forward + weighted CE, and backward (DDP syncs the
drafter's gradients, bucketed and overlapped with backward, on the last micro-batch only);
then clip, step, schedule. One code path for 1 process and N (torchrun); the frozen target
never enters a collective.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import functools
import gc
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from flashdraft import distributed, placement
from flashdraft.checkpoint import CheckpointManager
from flashdraft.config import Config, save_config
from flashdraft.data.batching import BatchSampler
from flashdraft.data.collate import Batch, CollateBuffers, pad_batch
from flashdraft.data.dataset import open_dataset
from flashdraft.drafter import DFlashDrafter
from flashdraft.evaluate import eos_ids_of, evaluate_tau, prompts_from_dataset, read_prompts
from flashdraft.feature_cache import CacheLookup, CacheStats, FeatureCache, full_cache_bytes
from flashdraft.metrics import (Progress, StageTimer, Throughput, format_bytes, format_line, open_metrics,
                                peak_memory_bytes)
from flashdraft.objective import block_loss, default_gamma, make_blocks
from flashdraft.pipeline import BufferPool, Pipeline, Stage
from flashdraft.target import TargetModel

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _target_tokenizer(target_dir: str):
    """The target directory's tokenizer, loaded once per start-up for the MASK-id lookup and the
    data's tokenizer check (a 152K-entry tokenizer takes about a second). Failures are not cached."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def resolve_mask_token_id(configured: int | None, target_dir: str) -> int:
    """The configured id, else the tokenizer's <|MASK|> (DFlash's convention) or mask_token."""
    if configured is not None:
        return configured
    try:
        tokenizer = _target_tokenizer(str(target_dir))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{target_dir}: no tokenizer to find the mask token in ({exc}); set model.mask_token_id") from None
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab:
        return vocab["<|MASK|>"]
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    raise ValueError(
        f"{target_dir}: the tokenizer has no <|MASK|> or mask token; set model.mask_token_id to an unused id "
        "inside the target's embedding table (Qwen3: 151669, the id <|MASK|> gets when added)"
    )


@contextlib.contextmanager
def output_lock(output: Path):
    """Hold an exclusive lock on OUTPUT/.lock while a run trains there: a second run on the same
    train.output_dir fails at once instead of interleaving its checkpoints and metrics with the
    first one's. Released by the kernel whatever way the process ends (flock), so a crash never
    leaves a stale lock."""
    output.mkdir(parents=True, exist_ok=True)
    with open(output / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ValueError(f"{output}: another flashdraft run ({f.read().strip() or 'unknown process'}) is training in "
                             "this train.output_dir; wait for it to end, or use another directory") from None
        except OSError as exc:  # a file system without flock: run unlocked rather than not at all
            log.warning("%s: cannot lock the output directory (%s); make sure no other run uses it", output, exc)
            yield
            return
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield


def warmup_cosine(total_steps: int, warmup_frac: float):
    """LR multiplier: linear warmup over warmup_frac of the steps, then cosine to 0."""
    warmup = max(1, round(total_steps * warmup_frac)) if warmup_frac > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(tuple(state["numpy"]) if isinstance(state["numpy"], list) else state["numpy"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]) if isinstance(py, list) else py)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class GracefulStop:
    """SIGTERM / SIGINT set a flag; the loop checkpoints at the end of the step and exits 0."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        if threading_main():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True
        log.warning("received %s: finishing this step, then checkpointing", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclass
class Micro:
    """One micro-batch on its way through the stages. Iterates as ``(batch, sample_ids)``.

    batch / sample_ids: host data (``batch`` is a view of a pooled CollateBuffers slot).
    device_batch / device_ids / features: filled by the target stage (``Trainer.stage_target``).
    cached: the feature cache's rows of this micro-batch (h2d part), when the cache is on.
    """

    batch: Batch
    sample_ids: np.ndarray
    device_batch: Batch | None = None
    device_ids: torch.Tensor | None = None
    features: torch.Tensor | None = None
    cached: CacheLookup | None = None

    def __iter__(self):
        return iter((self.batch, self.sample_ids))


@dataclass
class StepInput:
    """What the data stage produces per optimizer step: ``grad_accum`` micro-batches, the
    pooled buffer slot they live in, and the data cursor right after them (for checkpoints
    taken while the data thread is already ahead)."""

    micro: list[Micro]
    slot: list[CollateBuffers]
    sampler_state: dict


@dataclass
class StepStats:
    """Device-side sums since the last log (no host sync until logging)."""

    loss_total: torch.Tensor
    weight_total: torch.Tensor
    hits: torch.Tensor  # [bs - 1]
    counts: torch.Tensor  # [bs - 1]

    @classmethod
    def zeros(cls, block_size: int, device) -> "StepStats":
        z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float64)  # noqa: E731
        return cls(z(()), z(()), z(block_size - 1), z(block_size - 1))

    def add(self, out) -> None:
        self.loss_total += out.total.double()
        self.weight_total += out.weight_sum.double()
        self.hits += (out.correct & out.scored).flatten(0, 1).sum(0)[1:].double()
        self.counts += out.scored.flatten(0, 1).sum(0)[1:].double()

    def reduce(self) -> dict:
        """All-reduce over ranks and return host floats (deliberate sync: log time only)."""
        return self._values(distributed.all_reduce(self._packed(), "sum"))

    def reduce_local(self) -> dict:
        """This rank's values only (used by rank-0 evaluation)."""
        return self._values(self._packed())

    def _packed(self) -> torch.Tensor:
        return torch.cat([self.loss_total.view(1), self.weight_total.view(1), self.hits, self.counts])

    def _values(self, packed: torch.Tensor) -> dict:
        packed = packed.cpu()
        n = self.hits.numel()
        acc = packed[2 : 2 + n] / packed[2 + n :].clamp(min=1)
        return {
            "loss": float(packed[0] / packed[1].clamp(min=1e-12)),
            "acc": float(acc.mean()),
            "acc_first": float(acc[0]),
            "tau_sim": float(1 + acc.cumprod(0).sum()),
        }


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

    A training step frees and re-allocates the same multi-MB activations every step. By default
    glibc unmaps large freed blocks at once and trims the heap's top, so the next step
    page-faults them back in: 3-18 thousand faults per drafter step of the bench point, ~8 %
    of the CPU trainer's steps/s (docs/benchmarks.md). This is the host-side counterpart of
    CUDA's caching allocator, for CPU training (``train.keep_freed_host_memory``). It is
    process-wide and stays for the process's life: resident memory stays at its peak instead
    of shrinking between steps. Blocks up to 1 GiB are kept (glibc <= 2.34 accepts at most
    32 MiB; then that). Skipped where the user set glibc's own malloc tunables
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, glibc.malloc.* in GLIBC_TUNABLES), and off
    glibc. Returns whether it took effect."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    kept = mallopt(m_trim_threshold, 2**31 - 1)
    return bool(kept and (mallopt(m_mmap_threshold, 1 << 30) or mallopt(m_mmap_threshold, 32 << 20)))


class Trainer:
    """Builds everything from a Config and runs the loop; ``fit()`` returns the final metrics."""

    def __init__(self, config: Config):
        cfg = self.config = config
        disaggregated = cfg.pipeline.placement == "disaggregated"
        self.dist = distributed.init_distributed(cfg.train.device, cfg.train.collective_timeout_s,
                                                 num_target_ranks=cfg.pipeline.target_ranks if disaggregated else 0)
        self.device = self.dist.device
        if self.device.type == "cpu" and cfg.train.keep_freed_host_memory and keep_freed_host_memory():
            log.debug("glibc malloc keeps freed memory for reuse (CPU training)")
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        if not cfg.model.target:
            raise ValueError("config model.target is empty: give the Hugging Face target directory (model.target=DIR)")
        if not cfg.data.path:
            raise ValueError("config data.path is empty: give the training data (data.path=DIR, see `flashdraft prepare`)")
        self.output = Path(cfg.train.output_dir)
        # A drafter rank of a disaggregated job gets its features from a target rank: the embedding
        # and the LM head are all the loss needs of the target (the rank that runs evals loads it all).
        evaluates = self.dist.is_main and bool(cfg.data.eval_path or cfg.data.eval_prompts)
        self.target = TargetModel.from_pretrained(
            cfg.model.target, target_layer_ids=cfg.model.target_layer_ids, num_taps=cfg.model.num_taps,
            device=self.device, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code, heads_only=self.dist.role == "drafter" and not evaluates,
        )
        bs = cfg.model.block_size
        self.gamma = default_gamma(bs) if cfg.objective.gamma == 0 else cfg.objective.gamma
        self.drafter = DFlashDrafter.for_target(
            self.target, num_layers=cfg.model.num_draft_layers, block_size=bs,
            mask_token_id=resolve_mask_token_id(cfg.model.mask_token_id, cfg.model.target),
            attention=cfg.model.drafter_attention, activation_checkpointing=cfg.model.activation_checkpointing,
        )
        self.drafter.reset_parameters(cfg.optim.init_std, torch.Generator().manual_seed(cfg.train.seed))
        self.drafter.to(self.device)  # fp32 master weights; bf16 compute under autocast on GPU
        self.model = self.drafter
        if self.dist.world_size > 1 and self.dist.role != "target":
            # broadcast_buffers=False: the drafter's only buffers are constant RoPE tables; broadcasting
            # them would add a collective to every forward. process_group: the drafter ranks only.
            self.model = DDP(self.drafter, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                             gradient_as_bucket_view=True, broadcast_buffers=False, process_group=distributed.group())

        min_supervised = cfg.data.min_supervised if cfg.data.min_supervised is not None else 2 * bs
        open_kw = dict(vocab_size=self.target.config.vocab_size, max_length=cfg.data.max_length,
                       min_supervised=min_supervised, on_invalid=cfg.data.on_invalid, progress=self.dist.is_main)
        self.dataset = open_dataset(cfg.data.path, **open_kw)
        self.eval_dataset = open_dataset(cfg.data.eval_path, **open_kw) if cfg.data.eval_path else None
        self._check_tokenizer(self.dataset, self.eval_dataset)
        self._check_lengths(self.dataset)
        if self.eval_dataset is not None:  # found now, not at the first eval hours later
            self._check_lengths(self.eval_dataset)
        self.eval_prompt_ids = self._load_eval_prompts()
        self.sampler = self.batch_sampler(self.dist.rank, self.dist.world_size)
        steps_per_epoch = max(1, self.sampler.batches_per_epoch // cfg.train.grad_accum)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch

        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.total_steps, cfg.optim.warmup_frac))
        self.checkpoints = CheckpointManager(self.output / "checkpoints", cfg.train.keep_last)
        self.step = 0
        self.skipped_steps = 0
        self.timer = StageTimer(self.device, owner_only=True)  # main thread; the pipeline reports the rest
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else contextlib.nullcontext())
        # Serialises target forwards across threads: training forwards (target thread) vs eval
        # (main thread). Its hooks are per-module, and Triton autotuners (fla) are not thread-safe.
        self.target_lock = threading.Lock()
        self._data_state: dict | None = None  # cursor after the last step TRAINED (not collated)
        self.pipeline_report = None  # the last PipelineReport (per-stage busy/starved/blocked)
        self.feature_cache: FeatureCache | None = None  # lives while the pipeline runs (``_pipeline``)
        self.feature_cache_stats = None  # its final CacheStats
        # Recent metric records for callers and tests; bounded so a days-long run's memory stays flat
        # (metrics.jsonl holds them all).
        self.history: collections.deque[dict] = collections.deque(maxlen=1000)
        # Fault-injection tests pace the loop with this to kill it at a chosen moment.
        self._debug_step_sleep = float(os.environ.get("FLASHDRAFT_DEBUG_STEP_SLEEP", "0"))

    def _check_lengths(self, dataset) -> None:
        """Start-up refusal of samples no batch (or no target position) can hold."""
        cfg = self.config
        if len(dataset) == 0:
            raise ValueError(
                f"{dataset.report.source}: no usable samples ({dataset.report.to_dict()}); check the data "
                f"(`flashdraft inspect {dataset.report.source}`) or lower data.min_supervised"
            )
        longest = int(dataset.lengths.max())
        if longest > cfg.data.token_budget:
            raise ValueError(
                f"{dataset.report.source}: data.token_budget={cfg.data.token_budget} is smaller than the longest sample "
                f"({longest} tokens after truncation to data.max_length={cfg.data.max_length}); raise "
                f"data.token_budget to at least {longest} or lower data.max_length to {cfg.data.token_budget}"
            )
        max_pos = getattr(self.target.config, "max_position_embeddings", None)
        if max_pos and longest > max_pos:
            raise ValueError(
                f"{dataset.report.source}: samples of up to {longest} tokens exceed the target's "
                f"max_position_embeddings={max_pos}; lower data.max_length to {max_pos} (longer samples are truncated)"
            )

    def _load_eval_prompts(self) -> list[list[int]]:
        """Held-out prompts for tau, read and checked at start-up (not at the first eval)."""
        cfg = self.config
        if cfg.data.eval_prompts:
            prompts = read_prompts(cfg.data.eval_prompts)[: cfg.train.eval_prompts]
        elif self.eval_dataset is not None:
            prompts = prompts_from_dataset(self.eval_dataset, cfg.train.eval_prompts)
        else:
            return []
        vocab = int(self.target.config.vocab_size)
        for n, ids in enumerate(prompts):
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"{cfg.data.eval_prompts or cfg.data.eval_path}: prompt {n} has token ids outside "
                                 f"[0, {vocab}) (the target's vocabulary); re-tokenize it with the target's tokenizer")
        return prompts

    # ---- state ------------------------------------------------------------------------------

    def _check_tokenizer(self, *datasets) -> None:
        """Data prepared with another tokenizer than the target's has ids that mean other tokens;
        it trains without error when they fit the vocabulary. `prepare` records its vocabulary's
        fingerprint; compared here with the target directory's tokenizer, where both exist."""
        from flashdraft.data.prepare import vocab_fingerprint

        target = self.config.model.target
        fingerprint = None
        for dataset in datasets:
            wanted = getattr(dataset, "meta", {}).get("source", {}).get("vocab_sha256") if dataset is not None else None
            if wanted is None:
                continue
            if fingerprint is None:
                try:
                    fingerprint = vocab_fingerprint(_target_tokenizer(str(target)))
                except (OSError, ValueError):  # a target directory without a tokenizer: nothing to compare
                    return
            if fingerprint != wanted:
                prepared_with = dataset.meta["source"].get("tokenizer", "another tokenizer")
                raise ValueError(
                    f"{dataset.path}: prepared with the tokenizer of {prepared_with}, whose vocabulary differs from "
                    f"model.target's ({target}): its token ids mean other tokens. Re-run flashdraft prepare with "
                    f"--tokenizer {target}"
                )

    def state_parts(self) -> dict:
        return {
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "trainer": {"step": self.step, "skipped_steps": self.skipped_steps,
                        "sampler": self._data_state or self.sampler.state_dict(), "world_size": self.dist.world_size,
                        "identity": self.identity()},
        }

    def identity(self) -> dict:
        """What a resume must find unchanged behind the config's paths: the target model, the
        resolved MASK id and the training data (another target or dataset under the same path would
        resume silently, the sampler's cursor pointing into other samples)."""
        target = self.target.config
        return {"target": {"model_type": str(target.model_type), "vocab_size": int(target.vocab_size),
                           "hidden_size": self.target.hidden_size, "num_layers": self.target.num_layers},
                "mask_token_id": self.drafter.mask_token_id,
                "data": {"samples": len(self.dataset), "tokens": int(self.dataset.num_tokens)}}

    def save_checkpoint(self) -> Path:
        """Atomic checkpoint (collective) with the serving-format export inside it."""
        return self.checkpoints.save(
            self.step, self.state_parts(), per_rank_parts={"rng": rng_state()}, config=self.config.to_dict(),
            export_fn=lambda tmp: self.drafter.save_pretrained(tmp / "export"),
        )

    def maybe_resume(self) -> bool:
        mode = self.config.train.resume
        if mode == "never":
            if existing := self.checkpoints.checkpoints():
                # Starting over here would overwrite the earlier run's export and prune its
                # checkpoints (they are newer than the fresh run's first one): refuse instead.
                raise ValueError(
                    f"train.resume=never, but {self.checkpoints.root} holds checkpoints of an earlier run (newest "
                    f"{existing[0].name}), which a fresh run there would overwrite and prune; use another "
                    f"train.output_dir, or delete {self.config.train.output_dir} yourself to start over"
                )
            return False
        loaded = self.checkpoints.load_latest() if mode == "auto" else self.checkpoints.load(mode)
        if loaded is None:
            return False
        self._check_compatible(loaded.config or {})
        parts = loaded.parts
        saved = parts["trainer"].get("identity")  # absent in checkpoints of earlier versions
        if saved is not None and saved != (mine := self.identity()):
            diffs = [f"{k}: checkpoint {saved.get(k)} vs now {mine[k]}" for k in mine if saved.get(k) != mine[k]]
            raise ValueError(f"cannot resume from {self.checkpoints.root}: the target or the data behind the config's "
                             f"paths changed ({'; '.join(diffs)}); point model.target / data.path at what the run was "
                             "trained with, or start a fresh run with another train.output_dir")
        try:
            self.drafter.load_state_dict(parts["drafter"])
        except RuntimeError as exc:  # e.g. another target (hidden size) behind the same model.target path
            raise ValueError(f"cannot resume from {self.checkpoints.root}: its drafter does not fit "
                             f"this target/config ({str(exc).splitlines()[0]} ...); use the target it was trained "
                             "with, or start a fresh run with another train.output_dir") from None
        self.optimizer.load_state_dict(parts["optimizer"])
        self.scheduler.load_state_dict(parts["scheduler"])
        trainer = parts["trainer"]
        self.step, self.skipped_steps = int(trainer["step"]), int(trainer["skipped_steps"])
        self.sampler.load_state_dict(trainer["sampler"])  # re-split when the world size changed
        self._data_state = None
        if "rng" in parts and int(trainer["world_size"]) == self.dist.world_size:
            set_rng_state(parts["rng"])
        if self.dist.is_main:
            log.warning("resumed from step %d (%s)", self.step, self.checkpoints.root)
        return True

    def _check_compatible(self, saved: dict) -> None:
        """A resume must not silently change what is being trained."""
        mine = self.config.to_dict()
        keys = [("model", k) for k in ("num_draft_layers", "block_size", "target_layer_ids", "num_taps", "mask_token_id")]
        keys += [("data", k) for k in ("token_budget", "max_batch_size", "max_length")] + [("train", "seed")]
        diffs = [f"{s}.{k}: checkpoint {saved.get(s, {}).get(k)!r} vs now {mine[s][k]!r}"
                 for s, k in keys if saved.get(s, {}).get(k) != mine[s][k]]
        if diffs:
            raise ValueError(
                f"cannot resume from {self.checkpoints.root}: the config changed ({'; '.join(diffs)}); restore those "
                "values, or start a fresh run with another train.output_dir"
            )

    # ---- the step ---------------------------------------------------------------------------

    def stage_h2d(self, micro: list[Micro]) -> list[Micro]:
        """Copy micro-batches to the device (non_blocking from pinned buffers). Any thread."""
        with self.timer.stage("h2d"):
            for m in micro:
                if m.device_batch is None:
                    m.device_batch = m.batch.to(self.device)
                    m.device_ids = torch.from_numpy(m.sample_ids).to(self.device, non_blocking=True)
                    if self.feature_cache is not None:
                        m.cached = self.feature_cache.lookup(m.sample_ids, m.batch.lengths, self.device)
        return micro

    def stage_target(self, micro: list[Micro]) -> list[Micro]:
        """Stage 2: the frozen target's packed features per micro-batch. Any thread; never a
        collective. Idempotent, so the sequential path calls it from train_step."""
        self.stage_h2d(micro)
        for m in micro:
            if m.features is None:
                with self.target_lock, self.timer.stage("target"):
                    if m.cached is not None:  # the cache's rows; the target runs on the rest, if any
                        m.features = self.feature_cache.complete(m.cached, self.target, m.device_batch,
                                                                 m.sample_ids, m.batch.lengths)
                        m.cached = None
                    else:
                        m.features = self.target.features(m.device_batch.input_ids, m.device_batch.attention_mask)
        return micro

    def train_step(self, micro: list[Micro], stats: StepStats) -> torch.Tensor:
        """One optimizer step over micro-batches; returns the grad norm (device). Main thread.

        Runs the target stage for micro-batches the pipeline has not already processed."""
        cfg, bs = self.config, self.drafter.block_size
        micro = self.stage_target(micro)
        batches = [m.device_batch for m in micro]
        ids = [m.device_ids for m in micro]
        blocks = [
            make_blocks(b.input_ids, b.loss_mask, b.lengths, block_size=bs, mask_token_id=self.drafter.mask_token_id,
                        num_anchors=cfg.objective.num_anchors, gamma=self.gamma,
                        seed=cfg.train.seed * 1_000_003 + self.step, sample_ids=i)
            for b, i in zip(batches, ids)
        ]
        with self.timer.stage("sync"):
            # The global normaliser makes any split of the batch (ranks x micro-batches) give the
            # same gradient; DDP averages over ranks, hence the world_size factor.
            normalizer = distributed.all_reduce(torch.stack([blk.weight_sum for blk in blocks]).sum(), "sum")
            normalizer = normalizer / self.dist.world_size
        # Gradients are all-reduced once, on the last backward of the step (DDP no_sync before).
        pieces = [(m, part) for m, blk in zip(micro, blocks) for part in blk.slices(cfg.objective.anchors_per_microbatch)]
        outs = []
        for i, (m, part) in enumerate(pieces):
            features = m.features
            last = i == len(pieces) - 1
            no_sync = self.model.no_sync() if isinstance(self.model, DDP) and not last else contextlib.nullcontext()
            with no_sync:
                with self.timer.stage("drafter"), self.autocast, distributed.collective_errors("DDP forward"):
                    out = block_loss(self.model, self.target, features, part,
                                     chunk_size=cfg.objective.loss_chunk_size, normalizer=normalizer)
                # includes DDP's overlapped gradient all-reduce: a dead peer surfaces here
                with self.timer.stage("backward"), distributed.collective_errors("DDP gradient all-reduce (backward)"):
                    out.loss.backward()
            outs.append(out)
        # Device-side, read only when the step turns out non-finite: which samples' target
        # features were non-finite, and whether each micro-batch's loss was.
        checks = [(torch.isfinite(m.features).flatten(1).all(1),
                   torch.isfinite(torch.stack([o.total for (mm, _), o in zip(pieces, outs) if mm is m])).all())
                  for m in micro]
        for m in micro:
            m.features = None  # drop the references early: memory
        with self.timer.stage("optim"):
            clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip)
            bad = (~torch.isfinite(grad_norm) | ~torch.stack([loss_ok for _, loss_ok in checks]).all()).float()
            # All ranks must agree to skip (a local NaN loss need not reach every rank's gradients).
            # Deliberate sync: never let a non-finite loss or gradient into the weights.
            if distributed.all_reduce(bad, "max").item() == 0:
                self.optimizer.step()
                for out in outs:  # a skipped step's NaNs stay out of the logged loss too
                    stats.add(out)
            else:
                self._nonfinite(micro, grad_norm, checks)
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        return grad_norm

    def _nonfinite(self, micro, grad_norm, checks) -> None:
        """Count a skipped step and say where the non-finite values came from; raise past the limit."""
        self.skipped_steps += 1
        rows = [self.dataset.source_index[i] for _, i in micro]  # rows of the source file, not plan indices
        stage = None
        for k, (features_ok, loss_ok) in enumerate(checks):
            bad = rows[k][~features_ok.cpu().numpy()]
            if len(bad):
                stage = (f"target forward: non-finite target features for samples {bad[:16].tolist()} of "
                         f"{self.dataset.report.source} (micro-batch {k}); check those samples and the target's weights")
                break
        bad_loss = [k for k, (_, loss_ok) in enumerate(checks) if not bool(loss_ok)]
        if stage is None and bad_loss:
            stage = f"drafter forward: non-finite loss in micro-batch {bad_loss[0]} (features were finite)"
        elif stage is None and not torch.isfinite(grad_norm):
            stage = "backward: non-finite gradients (loss and features were finite)"
        elif stage is None:
            stage = "another rank's (this rank's features, loss and gradients were finite)"
        samples = np.concatenate(rows).tolist()
        msg = (f"step {self.step}: non-finite values on rank {self.dist.rank} (grad norm {float(grad_norm)}), "
               f"stage {stage}; step skipped, weights unchanged ({self.skipped_steps} skipped so far); batch samples "
               f"{samples[:16]}{'...' if len(samples) > 16 else ''}")
        if self.skipped_steps > self.config.train.max_nonfinite_steps:
            raise FloatingPointError(
                msg + f". More than train.max_nonfinite_steps={self.config.train.max_nonfinite_steps} skipped: "
                "stopping. Check those samples, lower optim.lr, or use model.dtype=float32 to rule out overflow."
            )
        log.warning(msg)

    def release_ddp(self) -> None:
        """Drop the DDP wrapper while the process group is still alive. Call before
        ``distributed.teardown()``: a DDP reducer that outlives the group and is the last owner of
        a gloo group destroys it from its destructor while holding the GIL, and a gloo thread it
        joins waits for the GIL -- the process hangs at exit (seen in ~1 of 3 two-rank CPU runs)."""
        self.model = self.drafter
        gc.collect()

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self) -> dict:
        if self.dist.role == "target":  # disaggregated: this rank only feeds its drafter ranks
            return placement.serve_features(self)
        with output_lock(self.output) if self.dist.is_main else contextlib.nullcontext():
            return self._fit()

    def _fit(self) -> dict:
        cfg = self.config
        main = self.dist.is_main
        self.maybe_resume()  # before anything is written: a refused resume leaves the directory as it was
        if main:
            self.output.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output / "config.yaml")
        metrics = open_metrics(self.output, cfg.train.metrics, is_main=main, config=cfg.to_dict())
        progress = Progress(self.total_steps, self.step, enabled=main)
        speed = Throughput()
        speed.update(self.step)
        stats = StepStats.zeros(self.drafter.block_size, self.device)
        last_saved = self.step
        tokens = 0
        record: dict = {}
        stopping = False
        self.drafter.train()
        with GracefulStop() as stop, self._pipeline() as (pipe, pool):
            for item in pipe:
                micro = item.micro
                tokens += sum(int(b.lengths.sum()) for b, _ in micro)  # host tensors: no device sync
                grad_norm = self.train_step(micro, stats)
                pool.release(item.slot)  # after the step: its event orders the slot's reuse after it
                self._data_state = item.sampler_state
                self.step += 1
                self.timer.step_done()
                if self._debug_step_sleep:
                    time.sleep(self._debug_step_sleep)
                speed.update(self.step, tokens)
                tokens = 0
                progress.update(self.step)
                done = self.step >= self.total_steps
                if self.step % cfg.train.log_every == 0 or done:
                    record = self._log(stats, grad_norm, speed, metrics, progress)
                    stats = StepStats.zeros(self.drafter.block_size, self.device)
                # Agreed before the periodic eval, so a stop request never waits for an eval.
                stopping = bool(distributed.all_reduce(torch.tensor(float(stop.requested)), "max").item()) \
                    if self.dist.world_size > 1 else stop.requested
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and not done and not stopping:
                    with self.target_lock:  # the target thread waits: no concurrent target forwards
                        self._eval(metrics, progress)
                    self.drafter.train()
                if stopping or (cfg.train.save_every and self.step % cfg.train.save_every == 0 and not done):
                    self.save_checkpoint()
                    last_saved = self.step
                if stopping:
                    progress.write(f"stopped by signal at step {self.step}; checkpoint saved")
                    break
            # Still under GracefulStop: a SIGTERM during the final eval/save must not kill the save.
            self.sampler.load_state_dict(self._data_state)  # rewind the data thread's read-ahead
            final = {}
            if self.step >= self.total_steps:
                if not stopping:  # a stop request skips the (possibly long) final eval
                    with self.target_lock:
                        final = self._eval(metrics, progress)
                if last_saved != self.step:
                    self.save_checkpoint()
                if main:
                    self.drafter.save_pretrained(self.output / "drafter")
        progress.close()
        metrics.close()
        return {**record, **final}

    @contextlib.contextmanager
    def _pipeline(self):
        """The stages of the remaining steps: data (plan + collate into pooled pinned buffers),
        target (H2D + frozen forward), and the drafter step = the caller's loop on this thread.

        pipeline.enabled=false runs the same stages inline (the sequential baseline). Yields
        (pipeline, buffer pool); closing joins every thread. On a disaggregated drafter rank the
        steps come from its target rank instead (``placement.drafter_pipeline``)."""
        if self.dist.role == "drafter":
            with placement.drafter_pipeline(self) as pipe_and_pool:
                yield pipe_and_pool
            return
        pcfg = self.config.pipeline
        threaded = pcfg.enabled
        pool = self.buffer_pool()
        if threaded and self.step < self.total_steps:
            self._warm_up_target()
        self.feature_cache = self._open_feature_cache()
        pipe = Pipeline(self._step_inputs(pool, self.total_steps - self.step), [
            Stage("target", self._target_stage, device=self.device, h2d=self._h2d_stage)],
            capacity=pcfg.capacity, threaded=threaded, pools=[pool], join_timeout_s=pcfg.join_timeout_s)
        self._pipe = pipe
        self._data_state = self.sampler.state_dict()  # before the data thread moves the sampler
        try:
            yield pipe, pool
        finally:
            pipe.close()
            self.pipeline_report = pipe.report(window=False)  # the whole run's stage split
            self._pipe = None
            if self.feature_cache is not None:  # after close: no stage thread uses it any more
                self.feature_cache_stats = self.feature_cache.stats()
                self.pipeline_report.notes.append(self.feature_cache_stats.format())
                self.feature_cache.close()
                self.feature_cache = None

    def _open_feature_cache(self) -> FeatureCache | None:
        """The target-feature cache of this run (pipeline.feature_cache_*), or None when off.
        Always starts empty: it is an optimisation, never part of a checkpoint."""
        pcfg = self.config.pipeline
        if not pcfg.feature_cache_bytes and not pcfg.feature_cache_disk_bytes:
            return None
        directory = Path(pcfg.feature_cache_dir) if pcfg.feature_cache_dir else self.output / "feature_cache"
        cache = FeatureCache(feature_size=self.target.feature_size, dtype=self.target.dtype,
                             ram_bytes=pcfg.feature_cache_bytes, disk_bytes=pcfg.feature_cache_disk_bytes,
                             directory=directory)
        if self.dist.is_main:
            need = full_cache_bytes(int(self.dataset.lengths.sum()), cache.feature_size, cache.itemsize)
            log.info("feature cache: RAM %s + disk %s per rank; the features of every sample take %s (each rank "
                     "sees a different 1/%d of them every epoch; docs/pipeline.md)", format_bytes(cache.ram_budget),
                     format_bytes(cache.disk_budget), format_bytes(need), self.dist.world_size)
        return cache

    def batch_sampler(self, rank: int, world_size: int) -> BatchSampler:
        """The training batch plan of data rank ``rank`` of ``world_size`` (a disaggregated
        target rank builds the plan of each drafter rank it feeds)."""
        data = self.config.data
        return BatchSampler(self.dataset.lengths, token_budget=data.token_budget, max_batch_size=data.max_batch_size,
                            seed=self.config.train.seed, rank=rank, world_size=world_size)

    def buffer_pool(self, extra_slots: int = 0) -> BufferPool:
        """Pooled collate buffers, one slot (``grad_accum`` micro-batches) per step that can be in
        flight: data filling + channel + target + channel + consumer when pipelined, else one;
        plus ``extra_slots`` (steps a consumer holds on to, e.g. sent but not yet received)."""
        capacity = self.config.pipeline.capacity
        num_slots = (2 * capacity + 3 if self.config.pipeline.enabled else 1) + extra_slots
        return BufferPool([[CollateBuffers() for _ in range(self.config.train.grad_accum)] for _ in range(num_slots)],
                          self.device)

    def collate_step(self, batches, slot: list[CollateBuffers], sampler: BatchSampler) -> StepInput:
        """One step: the next ``grad_accum`` batches of the plan iterator ``batches`` padded into
        the pooled ``slot``, with ``sampler``'s cursor after them."""
        micro = []
        for buffers in slot:
            _, _, idx = next(batches)
            micro.append(Micro(pad_batch(self.dataset, idx, buffers=buffers), idx))
        return StepInput(micro, slot, sampler.state_dict())

    def _step_inputs(self, pool: BufferPool, num_steps: int):
        """Stage 1 (data thread): plan + collate ``num_steps`` steps into pooled buffers."""
        batches = iter(self.sampler)
        for _ in range(num_steps):
            slot = pool.acquire()
            with self.timer.stage("data"):
                item = self.collate_step(batches, slot, self.sampler)
            yield item

    def _h2d_stage(self, item: StepInput) -> StepInput:
        self.stage_h2d(item.micro)
        return item

    def _target_stage(self, item: StepInput) -> StepInput:
        self.stage_target(item.micro)
        return item

    def _warm_up_target(self) -> None:
        """One target forward on this thread before the target thread starts: kernel autotuning
        (Triton / flash-linear-attention autotuners are not thread-safe) and lazy init happen
        here, serially. Later forwards are also serialised by ``target_lock``."""
        n = int(min(self.dataset.lengths.max(), 64))
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        with self.target_lock:
            self.target.features(ids, torch.ones_like(ids))

    def _log(self, stats: StepStats, grad_norm, speed: Throughput, metrics, progress) -> dict:
        values = stats.reduce()  # deliberate sync: log time only
        timing = self.timer.summary()
        pipe = {}
        if getattr(self, "_pipe", None) is not None:
            self.pipeline_report = self._pipe.report()  # per-stage busy/starved/blocked since the last log
            pipe = self.pipeline_report.as_metrics()
        record = {**values, "lr": self.scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                  "tokens_per_s": speed.tokens_per_s or 0.0, "s_per_step": speed.s_per_step or 0.0,
                  "skipped_steps": self.skipped_steps, **timing.as_metrics(), **pipe, **self._cache_metrics()}
        self.history.append({"step": self.step, **record})
        metrics.log(self.step, record)
        progress.write(format_line(
            self.step, self.total_steps,
            {"loss": values["loss"], "acc": values["acc"], "tau~": values["tau_sim"], "lr": record["lr"]},
            tokens_per_s=speed.tokens_per_s, s_per_step=speed.s_per_step, eta_s=speed.eta_s(self.total_steps),
            shares=timing.share, peak_mem_bytes=peak_memory_bytes(self.device),
        ))
        return record

    def _cache_metrics(self) -> dict:
        """The feature cache's counters summed over ranks (since the start; every rank logs at
        the same steps, so the all-reduce lines up). Empty when the cache is off."""
        if self.feature_cache is None:
            return {}
        mine = asdict(self.feature_cache.stats())
        total = distributed.all_reduce(torch.tensor(list(mine.values()), dtype=torch.float64, device=self.device),
                                       "sum").tolist()  # deliberate sync: log time
        return CacheStats(**{k: int(v) for k, v in zip(mine, total)}).as_metrics()

    @torch.no_grad()
    def _eval(self, metrics, progress) -> dict:
        """Held-out loss/accuracy and REAL tau on held-out prompts (rank 0; others wait)."""
        result: dict = {}
        if self.dist.is_main:
            self.drafter.eval()
            cfg = self.config
            if self.eval_dataset is not None:
                result.update(self.eval_loss())
            prompts = self.eval_prompt_ids
            if prompts:
                with self.autocast:
                    report = evaluate_tau(self.target, self.shipped_drafter(), prompts,
                                          max_new_tokens=cfg.train.eval_max_new_tokens,
                                          eos_ids=eos_ids_of(cfg.model.target, self.target.config), check_lossless=False)
                result.update(eval_tau=report["tau"], eval_acceptance=report["per_position_acceptance"])
            if result:
                metrics.log(self.step, result)
                self.history.append({"step": self.step, **result})
                progress.write(f"eval step {self.step}: " + " ".join(
                    f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float)))
        distributed.barrier()
        return result

    def shipped_drafter(self) -> DFlashDrafter:
        """The drafter as the serving export holds it (weights rounded to bf16), for tau: the
        eval measures what users will serve, and equals `flashdraft eval` on the export."""
        shipped = DFlashDrafter(self.drafter.config, attention=self.drafter.attention)
        shipped.load_state_dict({k: v.to(torch.bfloat16) for k, v in self.drafter.state_dict().items()})
        return shipped.to(self.device).eval()

    def eval_loss(self, max_batches: int = 8) -> dict:
        """Weighted CE / accuracy / simulated tau on the held-out set (fixed anchors: seed 0)."""
        cfg, bs = self.config, self.drafter.block_size
        stats = StepStats.zeros(bs, self.device)
        plan = BatchSampler(self.eval_dataset.lengths, token_budget=cfg.data.token_budget,
                            max_batch_size=cfg.data.max_batch_size, seed=0)
        buffers = CollateBuffers()
        for n, (_, _, idx) in enumerate(plan):
            if n >= min(max_batches, plan.batches_per_epoch):
                break
            batch = pad_batch(self.eval_dataset, idx, buffers=buffers).to(self.device)
            blk = make_blocks(batch.input_ids, batch.loss_mask, batch.lengths, block_size=bs,
                              mask_token_id=self.drafter.mask_token_id, num_anchors=cfg.objective.num_anchors,
                              gamma=self.gamma, seed=0, sample_ids=torch.from_numpy(idx).to(self.device))
            with self.autocast:
                out = block_loss(self.drafter, self.target, self.target.features(batch.input_ids, batch.attention_mask),
                                 blk, chunk_size=cfg.objective.loss_chunk_size)
            stats.add(out)
        values = {}
        for k, v in stats.reduce_local().items():
            values[f"eval_{k}"] = v
        return values


def train(config: Config) -> dict:
    trainer = Trainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.release_ddp()
        distributed.teardown()


# ---- `flashdraft train` --------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="YAML config file (sections model, data, objective, optim, train)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 model.target=DIR")


def run(args) -> int:
    from flashdraft.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_config(args.config, args.overrides)
    result = train(config)
    if int(os.environ.get("RANK", "0")) == 0:  # the process group is already torn down here
        keys = ("loss", "acc", "tau_sim", "eval_loss", "eval_tau", "tokens_per_s", "skipped_steps")
        print("final: " + " ".join(f"{k} {result[k]:.4g}" for k in keys if isinstance(result.get(k), (int, float))),
              file=sys.stderr)
    return 0
