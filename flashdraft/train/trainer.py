"""The online trainer: `flashdraft train`.

``train(config)`` is the entry point: it starts the process, then a disaggregated target rank
serves features (flashdraft.train.target_rank) and every other rank trains: ``Trainer(config)``
builds the run's parts; ``fit()`` is the loop. Each optimizer step the rank's Feed
(flashdraft.feed) delivers ``grad_accum`` micro-batches with the frozen target's features, and
``DrafterStep`` (flashdraft.train.step) trains the drafter on them: the run's strategy (the
drafter family's blocks and loss), then its backend (DDP, the optimizer). Every "when" has its
owner: the log decides when to write, the validator when to evaluate, the checkpoints when to
save; the loop asks them in that order. It returns a ``TrainResult``.
One code path for 1 process and N (torchrun); the frozen target never enters a collective.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashdraft import distributed
from flashdraft.checkpoint import step_dir_name
from flashdraft.config import Config, TrainConfig, save_config
from flashdraft.data.batching import BatchSampler
from flashdraft.distributed import Dist
from flashdraft.drafter import DFlashDrafter, serving
from flashdraft.evaluate import eos_ids_of
from flashdraft.feed import Feed, open_feed
from flashdraft.metrics import StageTimer
from flashdraft.signals import Stopped
from flashdraft.speculative import Sampling
from flashdraft.train import checks, startup
from flashdraft.train.backend import Backend
from flashdraft.train.log import TrainLog
from flashdraft.train.optim import build_optimizer
from flashdraft.train.runtime import GracefulStop, ProcessRNG, output_lock
from flashdraft.train.state import Resumed, RunCheckpoints, TrainState, run_identity
from flashdraft.train.step import DrafterStep, describe_nonfinite
from flashdraft.train.strategy import freeze_untrained, strategy_for
from flashdraft.train.target_rank import TargetRank
from flashdraft.train.validation import Validator

if TYPE_CHECKING:
    from flashdraft.feed import CacheStats, PipelineReport
    from flashdraft.target import TargetModel

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


def steps_left(sampler: BatchSampler, train: TrainConfig, step: int) -> int:
    """Optimizer steps the run's budget has left after ``step``: ``train.max_steps`` minus the
    steps done, or the steps the plan's remaining batches make at ``train.grad_accum`` per step
    (the last one may hold fewer), so that a run resumed at another world size or grad_accum
    trains exactly the samples the plan has left."""
    if train.max_steps:
        return max(0, train.max_steps - step)
    return -(-sampler.batches_left(train.epochs) // train.grad_accum)


def initial_drafter(cfg: Config, target: TargetModel) -> DFlashDrafter:
    """The run's drafter before its first step, on the host: built for ``target`` as the config
    says and drawn from the seeded init (``train.seed``), or holding the weights of the released
    drafter it starts from (drafter.init_from, whose shape the config already took:
    startup.with_init_from). The trainer starts from it, and anyone can rebuild a run's starting
    weights without a Trainer (the quickstart's untrained baseline)."""
    mask_token_id = checks.resolve_mask_token_id(cfg.drafter.mask_token_id, cfg.target.path)
    drafter = DFlashDrafter(serving.drafter_config_of(cfg.drafter, target.config, target.layer_ids,
                                                      mask_token_id),
                            attention=cfg.drafter.attention,
                            activation_checkpointing=cfg.drafter.activation_checkpointing)
    if cfg.drafter.init_from:
        released = serving.read_weights(cfg.drafter.init_from)
        try:
            drafter.load_state_dict({k: v.float() for k, v in released.items()})
        except RuntimeError as exc:  # names or shapes its config.json does not describe
            raise ValueError(f"drafter.init_from={cfg.drafter.init_from}: its model.safetensors does not "
                             f"fit its config.json ({str(exc).splitlines()[0]}); give an export as written "
                             "by flashdraft export, z-lab or SpecForge") from None
    else:
        drafter.reset_parameters(cfg.optim.init_std, torch.Generator().manual_seed(cfg.train.seed))
    freeze_untrained(drafter, cfg.objective)
    return drafter


class Trainer:
    """Builds everything from a Config; ``fit()`` runs the loop and returns the final metrics.
    ``dist``: the started process (``startup.start_process``; None: start it here). A drafter
    or colocated rank: a disaggregated target rank serves features instead (``train``)."""

    def __init__(self, config: Config, dist: Dist | None = None):
        cfg = self.config = startup.with_init_from(config)
        self.dist = dist if dist is not None else startup.start_process(cfg)
        if self.dist.role == "target":
            raise ValueError("a disaggregated target rank trains nothing: start it with "
                             "flashdraft.train.trainer.train(config), which serves its features")
        self.device = self.dist.device
        startup.check_run(cfg, self.dist)  # before any weights load
        self.output = Path(cfg.train.output_dir)
        self.run_config = cfg.to_dict()  # the run's record: saved with each checkpoint, in the metrics
        self.target = self.backend = None  # what close() releases, once built
        try:
            self._build(cfg)
        except BaseException:
            self.close()  # an engine target's process ends with a failed start too
            raise

    def _build(self, cfg: Config) -> None:
        self._build_models()
        data = startup.open_data(cfg, self.dist, self.target, self.drafter.mask_token_id)
        self.dataset, self.eval_dataset, self.eval_prompt_ids = (data.dataset, data.eval_dataset,
                                                                 data.eval_prompt_ids)
        # a tensor-parallel target's group shares one batch plan: the data ranks are the groups
        self.sampler = startup.batch_plan(cfg, self.dataset, self.dist.data_rank, self.dist.data_world_size)
        # a resume recounts it (_recount_budget)
        self.total_steps = max(1, steps_left(self.sampler, cfg.train, 0))
        # every parameter, frozen ones too (AdamW skips those without a gradient): the optimizer's
        # state then keeps one layout whatever objective.selector_alpha a resume brings
        self.optimizer, self.scheduler = build_optimizer(self.drafter.parameters(), cfg.optim,
                                                         self.total_steps, self.device)
        self.state = TrainState(self.sampler, self.dist.world_size,
                                run_identity(self.target, self.drafter.mask_token_id, self.dataset))
        self.checkpoints = RunCheckpoints(
            cfg.checkpoint, self.output, self.run_config,
            {"drafter": self.drafter, "optimizer": self.optimizer, "scheduler": self.scheduler,
             "trainer": self.state},
            {"rng": ProcessRNG()},
            export_fn=lambda tmp: self.drafter.save_pretrained(tmp / "export"))
        if self.dist.is_main:  # the slow part of a resume (hashing every file), before the ranks meet
            self.checkpoints.verify_ahead()
        startup.meet()  # where a disaggregated target rank meets it too (TargetRank)
        self.strategy = strategy_for(self.drafter, self.target, cfg.objective, seed=cfg.train.seed,
                                     shard=(self.dist.tensor_rank, self.dist.tensor_size))
        # DDP over the drafter ranks: its constructor broadcasts the weights (a device collective)
        self.backend = Backend(self.drafter, self.optimizer, self.scheduler, grad_clip=cfg.optim.grad_clip,
                               world_size=self.dist.world_size)
        self.timer = StageTimer(self.device, owner_only=True)  # main thread; the feed reports the rest
        self.autocast = autocast_for(self.device, self.target.dtype)
        self.stop = GracefulStop()  # its handlers are installed while the loop runs (_fit)
        self.step_fn = DrafterStep(self.strategy, self.backend, self.timer, self.autocast, stop=self.stop)
        evals = cfg.eval
        self.validator = Validator(
            evals, self.strategy, self.eval_dataset,
            functools.partial(startup.eval_plan, cfg, self.eval_dataset), self.eval_prompt_ids,
            sampling=Sampling(evals.temperature, evals.top_p, evals.top_k, cfg.train.seed),
            # the target's own files, read only where there are prompts to decode
            eos_ids=eos_ids_of(cfg.target.path, self.target.config) if self.eval_prompt_ids else [],
            device=self.device,
            autocast=self.autocast, target_lock=self.target.lock, is_main=self.dist.is_main,
            runs_eval=self.dist.is_main or (self.target.sharded and self.dist.data_rank == 0))
        self.feed: Feed | None = None  # this run's, once fit starts
        self.log: TrainLog | None = None

    def _build_models(self) -> None:
        """The frozen target and the drafter (fp32 master weights, on this rank's device)."""
        cfg = self.config
        self.target = startup.load_target(cfg, self.dist)
        self.drafter = initial_drafter(cfg, self.target)
        self.drafter.to(self.device)  # fp32 master weights; bf16 compute under autocast on GPU

    @property
    def model(self):
        """The drafter as the step trains it: DDP-wrapped in a multi-rank job, else the drafter."""
        return self.backend.model

    @property
    def feature_cache_stats(self):
        """The feature cache's CacheStats, final once the run ended (None when it was off)."""
        return self.feed.cache_stats() if self.feed is not None else None

    @property
    def pipeline_report(self):
        """The whole run's PipelineReport (per-stage busy/starved/blocked, the feature cache's
        counters in its notes), once the run ended."""
        return self.feed.report if self.feed is not None else None

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
        line, eval and checkpoint. Returns the last log record and the final eval."""
        with output_lock(self.output) if self.dist.is_main else contextlib.nullcontext():
            return self._fit(on_step)

    def _fit(self, on_step: StepHook | None) -> dict:
        cfg, main, state = self.config, self.dist.is_main, self.state
        # before anything is written
        resumed = self.checkpoints.resume(state.identity, self.dist.world_size, main)
        if resumed is not None:
            if main:
                self._warn_if_steps_resized(resumed)
            self._recount_budget()
        if main:
            self.output.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output / "config.yaml")
        self.log = TrainLog(cfg.train, self.run_config, self.dist, self.device, self.timer, self.strategy,
                            self.total_steps, state.step)
        if cfg.drafter.init_from and state.step == 0 and (cfg.eval.data_path or cfg.eval.prompts_path):
            # step 0 (every rank): the released drafter's own tau, the fine-tuning's baseline
            self._validate()
        stopping = 0
        self.drafter.train()
        with self.stop as stop:
            with self._feed(stop) as feed:
                for item in feed:
                    if stopping := self._train_one(item, feed, stop, on_step):
                        break
            # Still under GracefulStop: a SIGTERM during the final eval/save must not kill the save.
            state.rewind_read_ahead()
            done = state.step >= self.total_steps
            if not (done or stopping or stop.requested):
                raise RuntimeError(f"the data plan ended at step {state.step} of the {self.total_steps} "
                                   "counted for it (a flashdraft bug: please report it); the last checkpoint "
                                   "is intact")
            # the last step's eval, checkpoint and export: once the feed closed (not timed as its work)
            if done:
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
            return Stopped(signum, f"stopped by {name} at step {step} of {self.total_steps}: checkpoint "
                                   f"{saved} saved; run the same command again to resume from it")
        return Stopped(signum, f"stopped by {name} after the last step ({step}): checkpoint {saved} and the "
                               f"serving export {self.output / 'drafter'} saved; the run is complete")

    def _recount_budget(self) -> None:
        """After a resume: the steps the run's budget has left, at this world size and grad_accum
        (the budget belongs to the run, not to its layout), and the LR schedule spread over them
        when their number changed (no jump, still ending at 0)."""
        step, remaining = self.state.step, steps_left(self.sampler, self.config.train, self.state.step)
        if remaining > 0 and self.scheduler.ended(step):  # raised max_steps / epochs after the run's end
            train = self.config.train
            budget = (f"train.max_steps={train.max_steps}" if train.max_steps
                      else f"train.epochs={train.epochs}")
            raise ValueError(
                f"cannot train {remaining} more steps in {self.output}: its run ended its learning-rate "
                f"schedule at step {step} (warmup, then cosine down to 0), so with {budget} every added step "
                "would train at learning rate 0 and change nothing. The run is complete (its export: "
                f"{self.output / 'drafter'}); restore the budget it ran with, or train more in a new run "
                "with another train.output_dir (a schedule of its own; it starts from a fresh drafter)")
        self.total_steps = step + remaining
        if self.scheduler.continue_over(step, remaining) and self.dist.is_main:
            log.warning("resumed at step %d with %d steps left (world size %d, grad_accum %d): the "
                        "learning-rate schedule goes on from %.1f%% of its length and reaches its end at "
                        "step %d", step, remaining, self.dist.world_size, self.config.train.grad_accum,
                        100 * self.scheduler.position(step).fraction, self.total_steps)

    def _warn_if_steps_resized(self, resumed: Resumed) -> None:
        """train.max_steps counts steps, not samples: say so when a resume changes what a step holds
        (a budget of epochs is recounted instead: _recount_budget)."""
        train, world_size = self.config.train, self.dist.world_size
        saved_accum = resumed.config.get("train", {}).get("grad_accum")
        if (train.max_steps and saved_accum
                and resumed.world_size * saved_accum != world_size * train.grad_accum):
            log.warning("train.max_steps=%d counts optimizer steps: each step now takes %d batches (world "
                        "size %d x grad_accum %d) where the checkpoint's took %d (%d x %d), so the steps "
                        "left train %.2fx the samples they would have", train.max_steps,
                        world_size * train.grad_accum, world_size,
                        train.grad_accum, resumed.world_size * saved_accum, resumed.world_size, saved_accum,
                        world_size * train.grad_accum / (resumed.world_size * saved_accum))

    def _train_one(self, item, feed: Feed, stop: GracefulStop, on_step: StepHook | None) -> int:
        """One optimizer step on ``item``, then the hook and its log line, then (before the last
        step) its eval and checkpoint when due. Returns the signal the run stops on here (agreed
        by every rank), else 0."""
        state = self.state
        tokens = sum(int(b.lengths.sum()) for b, _ in item.micro)  # host tensors: no device sync
        grad_norm, nonfinite, voted_stop = self.step_fn(item.micro, state.step,
                                                        self.scheduler.position(state.step), self.log.stats)
        if nonfinite is not None:
            self._skip(nonfinite, item.micro)
        feed.done(item)  # after the step: its event orders the slot's reuse after it
        state.cursor = item.sampler_state
        state.step += 1
        self.timer.step_done()
        if on_step is not None:
            on_step(self)
        self.log.after_step(state.step, tokens, grad_norm, self.scheduler.get_last_lr()[0],
                            state.skipped_steps, feed)
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
            # a signal during the eval: save now, not after one more step (the last step saves anyway)
            if not done:
                stopping = self._stop_agreed(stop)
        if self.checkpoints.due(step, done, stopping):
            self.checkpoints.save(step)
        if stopping:
            self.log.write(f"stopped by signal at step {step}; checkpoint saved")
        if done and self.dist.is_main:  # the serving export: once, at the end (a stop at the last step too)
            self.drafter.save_pretrained(self.output / "drafter")
        return stopping

    def _feed(self, stop: GracefulStop) -> Feed:
        """The remaining steps' inputs from this rank's placement (kept for the run's report)."""
        state = self.state
        state.cursor = self.sampler.state_dict()  # before the data thread moves the sampler
        self.feed = open_feed(self.config, self.dist, target=self.target, dataset=self.dataset,
                              sampler=self.sampler, start_step=state.step, total_steps=self.total_steps,
                              timer=self.timer, stop=stop)
        return self.feed

    def _stop_agreed(self, stop: GracefulStop) -> int:
        """The signal any rank was asked to stop by, else 0 (every rank stops at the same step).
        A collective of its own: asked only after an eval (each step's vote carries the stop
        otherwise, Backend._vote)."""
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
        msg = describe_nonfinite(nonfinite, micro, self.dataset, state.step, self.dist.rank,
                                 state.skipped_steps)
        if state.skipped_steps > limit:
            raise FloatingPointError(
                msg + f". More than train.max_nonfinite_steps={limit} skipped: stopping. Check those "
                "samples, lower optim.lr, or use target.dtype=float32 to rule out overflow."
            )
        log.warning(msg)

    def close(self) -> None:
        """Release what the trainer holds beyond its objects, before ``distributed.teardown()``:
        the DDP wrapper while the process group is still alive (Backend.release) and the target's
        engine process, if any. Idempotent; ``with Trainer(...) as trainer`` calls it."""
        if self.backend is not None:
            self.backend.release()
        startup.close_target(self.target)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class TrainResult:
    """What a finished run hands back (``train``): everything a caller needs once the trainer and
    the process group are gone."""

    metrics: dict  # the last log record and the final eval (a disaggregated target rank: the steps it served)
    # the whole run's busy / starved / blocked per stage, the cache's line in its notes
    pipeline: PipelineReport | None
    feature_cache: CacheStats | None  # the feature cache's final counters (None: it was off)


def train(config: Config, on_step: StepHook | None = None) -> TrainResult:
    """The one entry point of a whole run (`flashdraft train`, the quickstart): build it, train it
    to the end or to a stop request (``on_step`` as in ``Trainer.fit``; ``Stopped`` then), and
    release DDP and the process group whatever happened."""
    dist = startup.start_process(config)
    try:
        if dist.role == "target":  # a disaggregated target rank serves features; it builds no Trainer
            with TargetRank(config, dist) as rank:
                return TrainResult(rank.serve(), None, None)
        with Trainer(config, dist) as trainer:
            metrics = trainer.fit(on_step)
            return TrainResult(metrics, trainer.pipeline_report, trainer.feature_cache_stats)
    finally:
        distributed.teardown()
