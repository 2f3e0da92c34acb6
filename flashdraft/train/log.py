"""The run's log: per-step loss statistics, throughput, where the step time goes, and when
all that is reduced and written (every ``train.log_every`` steps and at the end)."""

from __future__ import annotations

import collections
from dataclasses import asdict

import torch

from flashdraft import distributed
from flashdraft.config import TrainConfig
from flashdraft.feed import CacheStats
from flashdraft.metrics import Progress, Throughput, format_line, open_metrics, peak_memory_bytes
from flashdraft.train.strategy import Strategy


class TrainLog:
    """Accumulates on the device between log lines (no host sync per step); ``after_step``
    decides when to reduce over ranks and write: metrics.jsonl (and the other sinks) on the main
    rank, a human line through ``Progress``, and ``history``, the recent records for callers and
    tests (bounded, so a days-long run's memory stays flat; metrics.jsonl holds them all). The
    loss statistics are the sums the run's ``strategy`` keeps of its losses (Strategy.new_stats).
    ``train``: the run's train section (where, to which sinks, how often); ``run_config``: the
    whole run's config (``Config.to_dict``), which the sinks record."""

    def __init__(self, train: TrainConfig, run_config: dict, dist, device: torch.device, timer,
                 strategy: Strategy, total_steps: int, start_step: int):
        self.log_every, self.dist, self.device, self.timer = train.log_every, dist, device, timer
        self.strategy, self.total_steps = strategy, total_steps
        self.metrics = open_metrics(train.output_dir, train.metrics, is_main=dist.is_main, config=run_config,
                                    start_step=start_step)
        self.progress = Progress(total_steps, start_step, enabled=dist.is_main)
        self.speed = Throughput()
        self.speed.update(start_step)
        self.stats = strategy.new_stats(device)
        self.history: collections.deque[dict] = collections.deque(maxlen=1000)
        self.record: dict = {}  # the last log record
        self.last_eval: dict = {}  # the last evaluation's result (main rank)

    def after_step(self, step: int, tokens: int, grad_norm, lr: float, skipped_steps: int, feed) -> None:
        """Count a finished step (``tokens``: its host token count); log when due, with the
        ``feed``'s stage split and feature-cache counters."""
        self.speed.update(step, tokens)
        self.progress.update(step)
        if step % self.log_every == 0 or step >= self.total_steps:
            self.record = self._log(step, grad_norm, lr, skipped_steps, feed)
            self.stats = self.strategy.new_stats(self.device)

    def _log(self, step: int, grad_norm, lr: float, skipped_steps: int, feed) -> dict:
        values = self.stats.reduce()  # deliberate sync: log time only
        timing = self.timer.summary()
        pipe_metrics = feed.window_metrics()  # per-stage busy/starved/blocked since the last log
        speed = self.speed
        record = {**values, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": speed.tokens_per_s or 0.0, "s_per_step": speed.s_per_step or 0.0,
                  "skipped_steps": skipped_steps, **timing.as_metrics(),
                  **pipe_metrics, **self._cache_metrics(feed.cache_stats())}
        self.history.append({"step": step, **record})
        self.metrics.log(step, record)
        shown = ({"loss": values["loss"], "acc": values["acc"], "tau~": values["tau_sim"]} if values
                 else {"skipped": skipped_steps})
        self.progress.write(format_line(
            step, self.total_steps, {**shown, "lr": lr},
            tokens_per_s=speed.tokens_per_s, s_per_step=speed.s_per_step, eta_s=speed.eta_s(self.total_steps),
            shares=timing.share, peak_mem_bytes=peak_memory_bytes(self.device),
        ))
        return record

    def _cache_metrics(self, stats: CacheStats | None) -> dict:
        """This rank's feature-cache counters ``stats`` summed over ranks (since the start; every
        rank logs at the same steps, so the all-reduce lines up). Empty when the cache is off."""
        if stats is None:
            return {}
        mine = asdict(stats)
        total = distributed.all_reduce(torch.tensor(list(mine.values()), dtype=torch.float64,
                                                    device=self.device),
                                       "sum").tolist()  # deliberate sync: log time
        return CacheStats(**{k: int(v) for k, v in zip(mine, total)}).as_metrics()

    def eval_result(self, step: int, result: dict) -> None:
        """Write an evaluation's result (main rank)."""
        self.last_eval = result
        if not result:
            return
        self.metrics.log(step, result)
        self.history.append({"step": step, **result})
        self.progress.write(f"eval step {step}: " + " ".join(f"{k} {v:.4g}" for k, v in result.items()
                                                          if isinstance(v, float)))

    def write(self, line: str) -> None:
        self.progress.write(line)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
