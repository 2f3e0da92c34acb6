"""Validation during training: held-out loss / accuracy and the REAL tau (draft/verify decoding
on held-out prompts), and when to run them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashdraft import distributed
from flashdraft.config import EvalConfig
from flashdraft.data.batching import BatchSampler
from flashdraft.data.collate import CollateBuffers, pad_batch
from flashdraft.drafter import DFlashDrafter
from flashdraft.evaluate import evaluate_tau
from flashdraft.speculative import Sampling
from flashdraft.train.strategy import Strategy


class Validator:
    """Runs on the main rank (the others wait at a host-side barrier, train.pause_timeout_s)
    under ``target_lock`` (no target forward of the pipeline's target thread runs meanwhile)."""

    def __init__(self, evals: EvalConfig, strategy: Strategy, eval_dataset,
                 eval_plan: Callable[[], BatchSampler], prompts: list[list[int]], *, sampling: Sampling,
                 eos_ids: list[int], device: torch.device, autocast,
                 target_lock, is_main: bool, runs_eval: bool | None = None):
        """``evals``: the run's eval section (when, how many tokens); ``strategy``: the run's (its
        drafter and target, the eval loss's blocks and loss); ``eval_plan()``: a fresh batch plan of
        ``eval_dataset`` (``eval_dataset`` None: no held-out loss); ``prompts``: token ids for tau, decoded with
        ``sampling`` up to the target's ``eos_ids``. ``runs_eval``: this rank computes the
        evaluation (default: the main rank only; with a tensor-parallel target every rank of the
        main rank's target group, whose forwards need them all, in lockstep: same drafter, same
        prompts, same draws); the main rank reports it."""
        self.evals, self.strategy = evals, strategy
        self.drafter, self.target = strategy.drafter, strategy.target
        self.eval_dataset, self.eval_plan, self.prompts = eval_dataset, eval_plan, prompts
        self.sampling, self.eos_ids = sampling, eos_ids
        self.device, self.autocast, self.target_lock, self.is_main = device, autocast, target_lock, is_main
        self.runs_eval = is_main if runs_eval is None else runs_eval

    def due(self, step: int, done: bool, stopping: bool) -> bool:
        """Every ``eval.every`` steps and after the last one (``done``: the final eval), but
        never while stopping (a stop request must not wait for an eval)."""
        every = self.evals.every
        return not stopping and (done or (bool(every) and step % every == 0))

    @torch.no_grad()
    def run(self) -> dict:
        """Held-out loss / accuracy and real tau (rank 0; others wait). Leaves the drafter in
        eval mode; the caller puts it back in training mode."""
        result: dict = {}
        with self.target_lock:  # the target thread waits: no concurrent target forwards
            if self.runs_eval:
                self.drafter.eval()
                if self.eval_dataset is not None:
                    result.update(self.eval_loss())
                if self.prompts:
                    with self.autocast:
                        report = evaluate_tau(self.target, self.shipped_drafter(), self.prompts,
                                              max_new_tokens=self.evals.max_new_tokens, eos_ids=self.eos_ids,
                                              check_lossless=False, sampling=self.sampling)
                    result.update(eval_tau=report["tau"], eval_tau_pooled=report["tau_pooled"],
                                  eval_acceptance=report["per_position_acceptance"])
            # the eval takes minutes at real sizes: the others wait host-side, under the pause clock
            distributed.host_barrier("the eval on rank 0", "pause")
        return result if self.is_main else {}

    def shipped_drafter(self) -> DFlashDrafter:
        """The drafter as the serving export holds it (weights rounded to bf16) in the dtype
        `flashdraft eval` loads the export in (the target's), for tau: the eval measures what
        users will serve, and equals `flashdraft eval` on the export.

        Built on the eval device directly: the modules are made on the meta device (no memory,
        no init), then take each training weight rounded on its own device (one tensor at a
        time) and the training drafter's constant buffers (the fp32 RoPE tables). No host copy
        and no fp32 initialisation of a second drafter (seconds and GBs per eval at 8B sizes)."""
        dtype = self.target.dtype
        with torch.device("meta"):
            shipped = DFlashDrafter(self.drafter.config, attention=self.drafter.attention)
        weights = {k: v.detach().to(self.device, torch.bfloat16).to(dtype)
                   for k, v in self.drafter.state_dict().items()}
        shipped.load_state_dict(weights, assign=True)
        for name, buf in self.drafter.named_buffers():
            if name not in weights:  # non-persistent (never saved, the same in every drafter)
                module, _, leaf = name.rpartition(".")
                shipped.get_submodule(module)._buffers[leaf] = buf.to(self.device)
        return shipped.eval()

    def eval_loss(self, max_batches: int = 8) -> dict:
        """The training loss (weighted as in training) / accuracy / simulated tau on the held-out set,
        with the strategy's eval blocks (fixed anchors, every term at its full weight)."""
        strategy = self.strategy
        stats = strategy.new_stats(self.device)
        plan = self.eval_plan()
        buffers = CollateBuffers()
        for n, (_, _, idx) in enumerate(plan):
            if n >= min(max_batches, plan.batches_per_epoch):
                break
            batch = pad_batch(self.eval_dataset, idx, buffers=buffers).to(self.device)
            blocks = strategy.eval_blocks(batch, torch.from_numpy(idx).to(self.device))
            with self.autocast:
                features = self.target.features(batch.input_ids, batch.attention_mask)
                out = strategy.forward_loss(self.drafter, features, blocks)
            stats.add(out)
        return {f"eval_{k}": v for k, v in stats.reduce_local().items()}
