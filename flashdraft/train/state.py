"""What survives a restart, and when it is saved: the run's checkpoint components, resume and
the identity checks that keep a resume from silently training something else.

A run's state is a set of named components, each with ``state_dict`` / ``load_state_dict``:
the drafter, the optimizer, the LR scheduler and :class:`TrainState` (step counters and the
data cursor), identical on every rank, plus each rank's :class:`~flashdraft.train.runtime.ProcessRNG`.
:class:`RunCheckpoints` saves them through the :class:`~flashdraft.checkpoint.CheckpointManager`
(the only owner of checkpoint files), decides when a save is due, and restores them on resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.checkpoint import CheckpointError, CheckpointManager
from flashdraft.config import CheckpointConfig, resume_changes
from flashdraft.data.batching import BatchSampler

log = logging.getLogger(__name__)


def run_identity(target, mask_token_id: int, dataset) -> dict:
    """What a resume must find unchanged behind the config's paths: the target model, the
    resolved MASK id and the training data (another target or dataset under the same path would
    resume silently, the sampler's cursor pointing into other samples)."""
    config = target.config
    return {"target": {"model_type": str(config.model_type), "vocab_size": int(config.vocab_size),
                       "hidden_size": target.hidden_size, "num_layers": target.num_layers},
            "mask_token_id": mask_token_id,
            "data": {"samples": len(dataset), "tokens": int(dataset.num_tokens)}}


def upgrade_parts(parts: dict, version: int) -> dict:
    """The parts of a checkpoint of format ``version`` as the current version has them: the one
    place that knows older formats. Version 1 predates the run identity in the "trainer" part;
    its identity becomes None (resume then cannot check the target and data, and says so)."""
    if version < 2:
        parts = {**parts, "trainer": {"identity": None, **parts["trainer"]}}
    return parts


class TrainState:
    """The loop's progress: optimizer steps taken, steps skipped for non-finite values, and the
    data cursor after the last TRAINED step (the data thread reads ahead of it). Saved as the
    checkpoint part "trainer", with the world size and the run's identity beside it."""

    def __init__(self, sampler: BatchSampler, world_size: int, identity: dict):
        self.sampler, self.world_size, self.identity = sampler, world_size, identity
        self.step = 0
        self.skipped_steps = 0
        self.cursor: dict | None = None  # None: the sampler's own position (nothing read ahead)

    def state_dict(self) -> dict:
        return {"step": self.step, "skipped_steps": self.skipped_steps,
                "sampler": self.cursor or self.sampler.state_dict(), "world_size": self.world_size,
                "identity": self.identity}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped_steps = int(state["step"]), int(state["skipped_steps"])
        self.sampler.load_state_dict(state["sampler"])  # re-split when the world size changed
        self.cursor = None

    def rewind_read_ahead(self) -> None:
        """Put the sampler back at the cursor (after the data thread stopped reading ahead)."""
        if self.cursor is not None:
            self.sampler.load_state_dict(self.cursor)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from: its step, the world size and the config it was saved with."""

    step: int
    world_size: int
    config: dict


class RunCheckpoints:
    """The run's checkpoints under ``output_dir/checkpoints``, as its ``checkpoint`` config
    section says: when to save, what, and resuming from them. ``run_config``: the whole run's
    config (``Config.to_dict``), saved with each checkpoint and compared on resume (the fields a
    resume must find unchanged: config.resume_changes). ``components`` and ``per_rank`` map part
    names to objects with ``state_dict`` / ``load_state_dict``; ``export_fn(dir)`` writes the
    serving export into each checkpoint."""

    def __init__(self, checkpoint: CheckpointConfig, output_dir: Path, run_config: dict,
                 components: Mapping[str, Any], per_rank: Mapping[str, Any],
                 export_fn: Callable[[Path], None]):
        self.section, self.output_dir, self.run_config = checkpoint, Path(output_dir), run_config
        self.manager = CheckpointManager(self.output_dir / "checkpoints", checkpoint.keep_last)
        self.components, self.per_rank, self.export_fn = dict(components), dict(per_rank), export_fn
        self.last_saved: int | None = None
        self._verified: Path | None = None  # verify_ahead's choice (rank 0, resume=auto)
        self._verdict: str | None = None  # verify_ahead's verdict on resume=DIR (rank 0; "": complete)

    def verify_ahead(self) -> None:
        """Rank 0, before the ranks meet at start-up: find (and verify, hashing every file) the
        checkpoint ``resume`` will load, so that the others wait for it under the start-up
        timeout, not in the collective that shares the choice (checkpoint.resume=auto or DIR)."""
        mode = self.section.resume
        if mode == "auto":
            self._verified = self.manager.latest_complete()
        elif mode != "never":
            self._verdict = self.manager.verdict(mode)

    def due(self, step: int, done: bool, stopping: bool) -> bool:
        """Whether to save right after ``step``: on a stop request, every ``checkpoint.save_every``
        steps and after the last one (``done``), once per step (a run resumed at its end, or
        stopped at its last step, is saved already)."""
        every = self.section.save_every
        return step != self.last_saved and (bool(stopping) or done or (bool(every) and step % every == 0))

    def save(self, step: int) -> Path:
        """Atomic checkpoint of every component (collective) with the serving export inside."""
        path = self.manager.save(
            step, {name: c.state_dict() for name, c in self.components.items()},
            per_rank_parts={name: c.state_dict() for name, c in self.per_rank.items()},
            config=self.run_config, export_fn=self.export_fn,
        )
        self.last_saved = step
        return path

    def resume(self, identity: dict, world_size: int, is_main: bool) -> Resumed | None:
        """Load the checkpoint ``checkpoint.resume`` names (auto: the newest complete one) into every
        component; None when there is none to resume from. Refuses, naming the difference and
        the fix, a checkpoint of another config, target or dataset."""
        mode = self.section.resume
        if mode == "never":
            if existing := self.manager.checkpoints():
                # Starting over here would overwrite the earlier run's export and prune its
                # checkpoints (they are newer than the fresh run's first one): refuse instead.
                raise ValueError(
                    f"checkpoint.resume=never, but {self.manager.root} holds checkpoints of an earlier run "
                    f"(newest {existing[0].name}), which a fresh run there would overwrite and prune; use "
                    f"another train.output_dir, or delete {self.output_dir} yourself to start over"
                )
            return None
        loaded = (self.manager.load_latest(verified=self._verified) if mode == "auto"
                  else self.manager.load_shared(mode, verdict=self._verdict))
        if loaded is None:
            if existing := self.manager.checkpoints():  # a fresh start would train over them, then prune them
                raise CheckpointError(
                    f"{self.manager.root} holds {len(existing)} checkpoints (newest {existing[0].name}) but "
                    "none of them loads: each failed its manifest check (the warnings above name the file). "
                    f"Nothing was deleted. Repair them, or move {self.manager.root} aside to start over")
            return None
        self._check_compatible(loaded.config or {})
        parts = upgrade_parts(loaded.parts, loaded.version)
        if missing := sorted(set(self.components) - set(parts)):
            raise CheckpointError(f"{self.manager.root}: the step {loaded.step} checkpoint holds no "
                                  f"{', '.join(missing)} state, which a training checkpoint must (an edited "
                                  "manifest?); resume from another one with checkpoint.resume=DIR")
        saved = parts["trainer"]["identity"]
        if saved is None:
            log.warning("%s (format version %d) does not record the target and data it was trained on: "
                        "resuming without checking them", self.manager.root, loaded.version)
        elif saved != identity:
            diffs = [f"{k}: checkpoint {saved.get(k)} vs now {identity[k]}" for k in identity
                     if saved.get(k) != identity[k]]
            raise ValueError(f"cannot resume from {self.manager.root}: the target or the data behind the "
                             f"config's paths changed ({'; '.join(diffs)}); point target.path / data.path at "
                             "what the run was trained with, or start a fresh run with another "
                             "train.output_dir")
        for name, component in self.components.items():
            try:
                self._load(name, component, parts[name])
            except ValueError as exc:
                # e.g. the data cursor's batch plan: said with the checkpoint it came from
                if str(exc).startswith("cannot resume"):
                    raise
                raise ValueError(f"cannot resume from {self.manager.root} (step {loaded.step}): "
                                 f"{exc}") from None
        if int(parts["trainer"]["world_size"]) == world_size:  # else every rank re-seeds its generators
            for name, component in self.per_rank.items():
                if name in parts:
                    component.load_state_dict(parts[name])
        self.last_saved = loaded.step
        if is_main:
            log.warning("resumed from step %d (%s)", loaded.step, self.manager.root)
        return Resumed(loaded.step, int(parts["trainer"]["world_size"]), loaded.config or {})

    def _load(self, name: str, component, state) -> None:
        try:
            component.load_state_dict(state)
        except RuntimeError as exc:  # e.g. another target (hidden size) behind the same target.path path
            if name != "drafter":
                raise
            raise ValueError(f"cannot resume from {self.manager.root}: its drafter does not fit "
                             f"this target/config ({str(exc).splitlines()[0]} ...); use the target it was "
                             "trained with, or start a fresh run with another train.output_dir") from None

    def _check_compatible(self, saved: dict) -> None:
        """A resume must not silently change what is being trained."""
        if diffs := resume_changes(saved, self.run_config):
            raise ValueError(
                f"cannot resume from {self.manager.root}: the config changed ({'; '.join(diffs)}); restore "
                "those values, or start a fresh run with another train.output_dir"
            )
