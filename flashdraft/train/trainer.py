"""The online trainer: `flashdraft train`.

``train(config)`` is the entry point of a whole run (`flashdraft train`, the quickstart):
``Trainer(config)`` builds the run's parts; ``fit()`` is the loop. Each optimizer step the
feature stages (flashdraft.train.stages, wired by a placement strategy) deliver ``grad_accum``
micro-batches with the frozen target's features, and ``DrafterStep`` (flashdraft.train.step)
trains the drafter on them. Every "when" has its owner: the log decides when to write, the
validator when to evaluate, the checkpoints when to save; the loop asks them in that order.
One code path for 1 process and N (torchrun); the frozen target never enters a collective.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from flashdraft import distributed, plan
from flashdraft.checkpoint import step_dir_name
from flashdraft.config import Config, save_config
from flashdraft.data.dataset import open_dataset
from flashdraft.drafter import DFlashDrafter
from flashdraft.drafter.dflash2 import DFlash2Modules
from flashdraft.engine import last_layer_warning
from flashdraft.metrics import StageTimer
from flashdraft.objective import default_gamma
from flashdraft.target import TargetModel
from flashdraft.train import checks, placement
from flashdraft.train.log import TrainLog
from flashdraft.train.optim import build_optimizer
from flashdraft.train.runtime import (
    GracefulStop,
    ProcessRNG,
    Stopped,
    deterministic_mode,
    keep_freed_host_memory,
    output_lock,
)
from flashdraft.train.stages import FeatureStages, batch_sampler, steps_left
from flashdraft.train.state import RunCheckpoints, TrainState, run_identity
from flashdraft.train.step import DrafterStep, describe_nonfinite
from flashdraft.train.validation import Validator

if TYPE_CHECKING:
    from flashdraft.feature_cache import CacheStats
    from flashdraft.pipeline import PipelineReport

log = logging.getLogger(__name__)

StepHook = Callable[["Trainer"], None]


def autocast_for(device: torch.device, target_dtype: torch.dtype):
    """The drafter's mixed precision: bf16 autocast on CUDA; on CPU, autocast to a bf16 / fp16
    target's dtype (its features reach the fp32 drafter in that dtype, and a matmul of the two
    fails at step 1 without it), none for an fp32 target."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if target_dtype in (torch.bfloat16, torch.float16):
        return torch.autocast("cpu", dtype=target_dtype)
    return contextlib.nullcontext()


def initial_drafter(cfg: Config, target: TargetModel) -> DFlashDrafter:
    """The run's drafter before its first step, on the host: built for ``target`` as the config
    says and drawn from the seeded init (``train.seed``). The trainer starts from it, and anyone can
    rebuild a run's starting weights without a Trainer (the quickstart's untrained baseline)."""
    drafter = DFlashDrafter.for_target(
        target, num_layers=cfg.model.num_draft_layers, block_size=cfg.model.block_size,
        mask_token_id=checks.resolve_mask_token_id(cfg.model.mask_token_id, cfg.model.target),
        layer_types=cfg.model.layer_types, sliding_window=cfg.model.drafter_sliding_window,
        causal=cfg.model.drafter_causal, dflash2=DFlash2Modules.of(cfg.model), sinks=cfg.model.drafter_attention_sink,
        attention=cfg.model.drafter_attention, activation_checkpointing=cfg.model.activation_checkpointing,
    )
    drafter.reset_parameters(cfg.optim.init_std, torch.Generator().manual_seed(cfg.train.seed))
    if drafter.candidate_selector is not None and cfg.objective.selector_alpha == 0:
        drafter.candidate_selector.requires_grad_(False)  # frozen: no selector term, not optimised
    return drafter


class Trainer:
    """Builds everything from a Config; ``fit()`` runs the loop and returns the final metrics."""

    def __init__(self, config: Config):
        cfg = self.config = config
        if cfg.train.deterministic:  # before init_distributed touches CUDA: cuBLAS reads its workspace setting once
            deterministic_mode()
        disaggregated = cfg.pipeline.placement == "disaggregated"
        self.dist = distributed.init_distributed(cfg.train.device, cfg.train.collective_timeout_s,
                                                 num_target_ranks=cfg.pipeline.target_ranks if disaggregated else 0,
                                                 tensor_parallel=cfg.model.tensor_parallel,
                                                 startup_timeout_s=cfg.train.startup_timeout_s)
        self.device = self.dist.device
        if self.device.type == "cpu" and cfg.train.keep_freed_host_memory and keep_freed_host_memory():
            log.debug("glibc malloc keeps freed memory for reuse (CPU training)")
        checks.check_paths(cfg)
        checks.check_drafter_sizes(cfg, self.device)
        # before any weights load: a run that cannot fit its GPU is refused in seconds, not after them
        plan.check_fits(cfg, self.device)
        self.output = Path(cfg.train.output_dir)
        self._build_models()
        self._open_data()
        # a tensor-parallel target's group shares one batch plan: the data ranks are the groups
        self.sampler = batch_sampler(self.dataset, cfg, self.dist.data_rank, self.dist.data_world_size)
        self.total_steps = max(1, steps_left(self.sampler, cfg, 0))  # a resume recounts it (_recount_budget)
        # every parameter, frozen ones too (AdamW skips those without a gradient): the optimizer's
        # state then keeps one layout whatever objective.selector_alpha a resume brings
        self.optimizer, self.scheduler = build_optimizer(self.drafter.parameters(), cfg.optim, self.total_steps,
                                                         self.device)
        self.state = TrainState(self.sampler, self.dist.world_size,
                                run_identity(self.target, self.drafter.mask_token_id, self.dataset))
        self.checkpoints = RunCheckpoints(
            cfg, {"drafter": self.drafter, "optimizer": self.optimizer, "scheduler": self.scheduler,
                  "trainer": self.state}, {"rng": ProcessRNG()},
            export_fn=lambda tmp: self.drafter.save_pretrained(tmp / "export"))
        if self.dist.is_main:  # the slow part of a resume (hashing every file), before the ranks meet
            self.checkpoints.verify_ahead()
        # Each rank read the target (and maybe the data) from shared storage, at its own pace: meet
        # host-side under train.startup_timeout_s before the first device collective (DDP's broadcast).
        distributed.startup_barrier("loading the target and the data, and verifying the checkpoint to resume from")
        model = self._wrap(self.drafter)
        self.timer = StageTimer(self.device, owner_only=True)  # main thread; the pipeline reports the rest
        self.autocast = autocast_for(self.device, self.target.dtype)
        self.stages = FeatureStages(cfg, self.dataset, self.target, self.device, self.timer)
        self.stop = GracefulStop()  # its handlers are installed while the loop runs (_fit)
        self.step_fn = DrafterStep(model, self.drafter, self.target, self.optimizer, self.scheduler, cfg, self.gamma,
                                   self.timer, self.autocast, self.dist.world_size,
                                   (self.dist.tensor_rank, self.dist.tensor_size), stop=self.stop)
        self.validator = Validator(cfg, self.drafter, self.target, self.eval_dataset, self.eval_prompt_ids, self.gamma,
                                   self.device, self.autocast, self.stages.target_lock, self.dist.is_main,
                                   runs_eval=self.dist.is_main or (self.target.sharded and self.dist.data_rank == 0))
        self.pipeline_report = None  # the whole run's PipelineReport (per-stage busy/starved/blocked)
        self.log: TrainLog | None = None

    def _build_models(self) -> None:
        """The frozen target and the drafter (fp32 master weights, on this rank's device)."""
        cfg, bs = self.config, self.config.model.block_size
        # A drafter rank of a disaggregated job gets its features from a target rank: the embedding
        # and the LM head are all the loss needs of the target (the rank that runs evals loads it all).
        evaluates = self.dist.is_main and bool(cfg.data.eval_path or cfg.data.eval_prompts)
        self.target = TargetModel.from_pretrained(
            cfg.model.target, target_layer_ids=cfg.model.target_layer_ids, num_taps=cfg.model.num_taps,
            device=self.device, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code, heads_only=self.dist.role == "drafter" and not evaluates,
            **({} if self.dist.role == "drafter" else  # a disaggregated drafter rank: the (whole) heads only
               {"tensor_parallel": cfg.model.tensor_parallel, "expert_parallel": cfg.model.expert_parallel}),
        )
        if self.dist.is_main:  # a last-layer tap: the engines would serve other features than these
            last_layer_tap = last_layer_warning(self.target.layer_ids, self.target.num_layers)
            if last_layer_tap:
                log.warning("warning: %s", last_layer_tap)
        if self.target.sharded and self.dist.rank == 0:  # the first rank of the first target group
            local, whole = self.target.weight_bytes()
            log.warning("target sharded over %d ranks per group (%s parallel): %.2f GiB of its weights on each rank "
                        "(%.2f GiB unsharded), plus the gathered embedding and LM head the drafter uses",
                        cfg.model.tensor_parallel, "expert" if cfg.model.expert_parallel else "tensor",
                        local / 2**30, whole / 2**30)
        self.gamma = default_gamma(bs) if cfg.objective.gamma == 0 else cfg.objective.gamma
        self.drafter = initial_drafter(cfg, self.target)
        self.drafter.to(self.device)  # fp32 master weights; bf16 compute under autocast on GPU

    def _wrap(self, drafter: DFlashDrafter) -> torch.nn.Module:
        """The module the step trains: the drafter, DDP-wrapped over the drafter ranks in a
        multi-rank job (DDP's constructor broadcasts the weights: a device collective)."""
        if self.dist.world_size == 1 or self.dist.role == "target":
            return drafter
        # broadcast_buffers=False: the drafter's only buffers are constant RoPE tables; broadcasting
        # them would add a collective to every forward. process_group: the drafter ranks only.
        return DDP(drafter, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                   gradient_as_bucket_view=True, broadcast_buffers=False, process_group=distributed.group())

    def _open_data(self) -> None:
        """The training and held-out data and prompts, checked now rather than hours into the run."""
        cfg = self.config
        min_supervised = cfg.data.min_supervised if cfg.data.min_supervised is not None else 2 * cfg.model.block_size
        open_kw = dict(vocab_size=self.target.config.vocab_size, max_length=cfg.data.max_length,
                       min_supervised=min_supervised, on_invalid=cfg.data.on_invalid, progress=self.dist.is_main)
        self.dataset = open_dataset(cfg.data.path, **open_kw)
        self.eval_dataset = open_dataset(cfg.data.eval_path, **open_kw) if cfg.data.eval_path else None
        checks.check_tokenizer(cfg.model.target, self.dataset, self.eval_dataset)
        checks.check_mask_token(self.dataset, self.drafter.mask_token_id)
        for dataset in (self.dataset, self.eval_dataset):
            if dataset is not None:
                checks.check_lengths(dataset, cfg, self.target.config)
        self.eval_prompt_ids = checks.load_eval_prompts(cfg, self.eval_dataset, self.target.config)

    @property
    def model(self):
        """The drafter as the step trains it: DDP-wrapped in a multi-rank job, else the drafter."""
        return self.step_fn.model

    @property
    def feature_cache_stats(self):
        """The feature cache's final CacheStats, once the run ended (None when it was off)."""
        return self.stages.cache_stats

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def skipped_steps(self) -> int:
        return self.state.skipped_steps

    @property
    def history(self):
        return self.log.history if self.log is not None else ()

    # ---- the loop ---------------------------------------------------------------------------

    def fit(self, on_step: StepHook | None = None) -> dict:
        """Train to the end (or to a stop request); ``on_step(trainer)``, if given, runs on the
        main thread right after every optimizer step (``trainer.step`` counts it), before its log
        line, eval and checkpoint. Returns the last log record and the final eval (a disaggregated
        target rank: ``{"steps": steps sent to each drafter rank}``)."""
        if self.dist.role == "target":  # disaggregated: this rank only feeds its drafter ranks
            try:
                with GracefulStop() as stop:
                    result = placement.serve_features(self.stages, self.dist, stop)
            finally:
                self.pipeline_report = self.stages.report
            if result["stopped"]:  # the drafter ranks stopped early (a signal here or there): so does the job
                signum = stop.signum or signal.SIGTERM
                raise Stopped(signum, f"target rank {self.dist.global_rank} stopped after {result['steps']} steps "
                                      "(a stop request); its drafter ranks saved the checkpoint")
            return result
        with output_lock(self.output) if self.dist.is_main else contextlib.nullcontext():
            return self._fit(on_step)

    def _fit(self, on_step: StepHook | None) -> dict:
        cfg, main, state = self.config, self.dist.is_main, self.state
        if self.checkpoints.resume(state.identity, self.dist.world_size, main):  # before anything is written
            self._recount_budget()
        if main:
            self.output.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output / "config.yaml")
        self.log = TrainLog(cfg, self.dist, self.device, self.timer, self.drafter.block_size, self.total_steps,
                            state.step)
        stopping = 0
        self.drafter.train()
        with self.stop as stop:
            with self._feed(stop) as (pipe, pool):
                for item in pipe:
                    if stopping := self._train_one(item, pipe, pool, stop, on_step):
                        break
            # Still under GracefulStop: a SIGTERM during the final eval/save must not kill the save.
            state.rewind_read_ahead()
            done = state.step >= self.total_steps
            if not (done or stopping or stop.requested):
                raise RuntimeError(f"the data plan ended at step {state.step} of the {self.total_steps} counted for "
                                   "it (a flashdraft bug: please report it); the last checkpoint is intact")
            if done:  # the last step's eval, checkpoint and export: once the feed closed (not timed as its work)
                stopping = self._when_due(stop, stopping, done=True)
        self.log.close()
        if stopping or stop.requested:
            raise self._stopped(stopping or stop.signum)
        return {**self.log.record, **self.log.last_eval}

    def _stopped(self, signum: int) -> Stopped:
        """What a signal-stopped run tells the command: where its state was saved, how to go on."""
        step, name = self.state.step, signal.Signals(signum).name
        saved = self.checkpoints.manager.root / step_dir_name(step)
        if step < self.total_steps:
            return Stopped(signum, f"stopped by {name} at step {step} of {self.total_steps}: checkpoint {saved} "
                                   "saved; run the same command again to resume from it")
        return Stopped(signum, f"stopped by {name} after the last step ({step}): checkpoint {saved} and the "
                               f"serving export {self.output / 'drafter'} saved; the run is complete")

    def _recount_budget(self) -> None:
        """After a resume: the steps the run's budget has left, at this world size and grad_accum
        (the budget belongs to the run, not to its layout), and the LR schedule spread over them
        when their number changed (no jump, still ending at 0)."""
        step, remaining = self.state.step, steps_left(self.sampler, self.config, self.state.step)
        self.total_steps = step + remaining
        if self.scheduler.continue_over(step, remaining) and self.dist.is_main:
            log.warning("resumed at step %d with %d steps left (world size %d, grad_accum %d): the learning-rate "
                        "schedule goes on from %.1f%% of its length and reaches its end at step %d",
                        step, remaining, self.dist.world_size, self.config.train.grad_accum,
                        100 * self.scheduler.position(step).fraction, self.total_steps)

    def _train_one(self, item, pipe, pool, stop: GracefulStop, on_step: StepHook | None) -> int:
        """One optimizer step on ``item``, then the hook and its log line, then (before the last
        step) its eval and checkpoint when due. Returns the signal the run stops on here (agreed
        by every rank), else 0."""
        state = self.state
        tokens = sum(int(b.lengths.sum()) for b, _ in item.micro)  # host tensors: no device sync
        grad_norm, nonfinite, voted_stop = self.step_fn(item.micro, state.step, self.scheduler.position(state.step),
                                                        self.log.stats)
        if nonfinite is not None:
            self._skip(nonfinite, item.micro)
        pool.release(item.slot)  # after the step: its event orders the slot's reuse after it
        state.cursor = item.sampler_state
        state.step += 1
        self.timer.step_done()
        if on_step is not None:
            on_step(self)
        self.log.after_step(state.step, tokens, grad_norm, self.scheduler.get_last_lr()[0], state.skipped_steps,
                            pipe, self.stages.cache)
        # before the periodic eval: a stop never waits for one
        stopping = stop.signum if self.dist.world_size == 1 else voted_stop
        if state.step < self.total_steps:  # the last step's: once the feed closed (_fit)
            stopping = self._when_due(stop, stopping, done=False)
        return stopping

    def _when_due(self, stop: GracefulStop, stopping: int, *, done: bool) -> int:
        """After a step: its eval, its checkpoint and (the last step) the serving export, each
        when its owner says it is due -- the last step is due for all three, and a stop request
        skips the eval, never the save. Returns the signal the run stops on (agreed by every
        rank), else 0."""
        step = self.state.step
        if self.validator.due(step, done, stopping):
            self._validate()
            if not done:  # a signal during the eval: save now, not after one more step (the last step saves anyway)
                stopping = self._stop_agreed(stop)
        if self.checkpoints.due(step, done, stopping):
            self.checkpoints.save(step)
        if stopping:
            self.log.write(f"stopped by signal at step {step}; checkpoint saved")
        if done and self.dist.is_main:  # the serving export: once, at the end (a stop at the last step too)
            self.drafter.save_pretrained(self.output / "drafter")
        return stopping

    @contextlib.contextmanager
    def _feed(self, stop: GracefulStop):
        """The remaining steps' inputs from this rank's placement; the whole run's pipeline
        report (with the feature cache's counters) is kept once it closes."""
        state, remaining = self.state, self.total_steps - self.state.step
        state.cursor = self.sampler.state_dict()  # before the data thread moves the sampler
        if self.dist.role == "drafter":
            feed = placement.drafter_feed(self.config, self.dist, self.device, self.timer, self.sampler, state.step,
                                          self.total_steps, stop)
        else:
            feed = placement.colocated_feed(self.stages, self.sampler, remaining, self.dist)
        pipe = None
        try:
            with feed as (pipe, pool):
                yield pipe, pool
        finally:
            if pipe is not None:
                self.pipeline_report = pipe.report(window=False)  # the whole run's stage split
                if self.stages.cache_stats is not None:
                    self.pipeline_report.notes.append(self.stages.cache_stats.format())

    def _stop_agreed(self, stop: GracefulStop) -> int:
        """The signal any rank was asked to stop by, else 0 (every rank stops at the same step).
        A collective of its own: asked only after an eval (each step's vote carries the stop
        otherwise, DrafterStep._vote)."""
        if self.dist.world_size == 1:
            return stop.signum
        # on the device: an NCCL group takes no host tensors
        return int(distributed.all_reduce(torch.tensor(float(stop.signum), device=self.device), "max").item())

    def _validate(self) -> dict:
        result = self.validator.run()
        if self.dist.is_main:
            self.log.eval_result(self.state.step, result)
        self.drafter.train()
        return result

    def _skip(self, nonfinite, micro) -> None:
        """Count a skipped step and say where its non-finite values came from; raise past the limit."""
        state, limit = self.state, self.config.train.max_nonfinite_steps
        state.skipped_steps += 1
        msg = describe_nonfinite(nonfinite, micro, self.dataset, state.step, self.dist.rank, state.skipped_steps)
        if state.skipped_steps > limit:
            raise FloatingPointError(
                msg + f". More than train.max_nonfinite_steps={limit} skipped: stopping. Check those samples, "
                "lower optim.lr, or use model.dtype=float32 to rule out overflow."
            )
        log.warning(msg)

    def release_ddp(self) -> None:
        """Drop the DDP wrapper while the process group is still alive. Call before
        ``distributed.teardown()``: a DDP reducer that outlives the group and is the last owner of
        a gloo group destroys it from its destructor while holding the GIL, and a gloo thread it
        joins waits for the GIL -- the process hangs at exit (seen in ~1 of 3 two-rank CPU runs)."""
        self.step_fn.model = self.drafter
        gc.collect()


@dataclass(frozen=True)
class TrainResult:
    """What a finished run hands back (``train``): everything a caller needs once the trainer and
    the process group are gone."""

    metrics: dict  # the last log record and the final eval (a disaggregated target rank: the steps it served)
    pipeline: PipelineReport | None  # the whole run's busy / starved / blocked per stage, the cache's line in its notes
    feature_cache: CacheStats | None  # the feature cache's final counters (None: it was off)


def train(config: Config, on_step: StepHook | None = None) -> TrainResult:
    """The one entry point of a whole run (`flashdraft train`, the quickstart): build it, train it
    to the end or to a stop request (``on_step`` as in ``Trainer.fit``; ``Stopped`` then), and
    release DDP and the process group whatever happened."""
    trainer = Trainer(config)
    try:
        metrics = trainer.fit(on_step)
        return TrainResult(metrics, trainer.pipeline_report, trainer.feature_cache_stats)
    finally:
        trainer.release_ddp()
        distributed.teardown()
