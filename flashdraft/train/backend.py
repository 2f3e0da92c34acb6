"""The optimizer side of the drafter's step: everything that depends on how many ranks train one
drafter, and nothing of its family or its loss (train/strategy.py).

``Backend`` owns the drafter's DDP wrapper over the drafter ranks (``model``, what a forward runs
through), DDP's ``no_sync`` around all but a step's last forward + backward (``accumulating``),
the global loss normaliser (one all-reduce of a scalar, no host sync), and the step's end
(``step``): the clip, the vote, the optimizer and scheduler steps. The vote is the step's one
host sync: a single all-reduce of two numbers over the ranks, whether any rank's step was
non-finite (then every rank skips it) and the signal any rank has been asked to stop by (then
every rank stops after it).
"""

from __future__ import annotations

import contextlib
import gc
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from flashdraft import distributed

_SYNCING = contextlib.nullcontext()  # re-enterable: the context of a forward + backward that all-reduces


class Update(NamedTuple):
    """The end of an optimizer step: the gradients' norm before clipping (device), whether the
    update was applied (every rank agrees), and the signal any rank was asked to stop by (0: none)."""

    grad_norm: torch.Tensor
    applied: bool
    stop: int


class Backend:
    """DDP, the gradients' sync, the clip, the vote, the optimizer and the scheduler of one
    drafter (see the module doc)."""

    def __init__(self, drafter: torch.nn.Module, optimizer=None, scheduler=None, *, grad_clip: float = 0.0,
                 world_size: int = 1):
        """``drafter``: the fp32 master weights, on this rank's device; ``optimizer`` / ``scheduler``:
        its optimizer and LR schedule (None: a backend that only runs forwards and backwards, as
        the benchmarks and the memory plan do); ``grad_clip``: the max grad norm (0: none);
        ``world_size``: the drafter ranks, each with a replica. Over 1, DDP wraps the drafter
        here: its constructor broadcasts the weights, a device collective every rank must reach."""
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler
        self.clip = grad_clip if grad_clip > 0 else float("inf")
        self.world_size = world_size
        self.model = self._wrap(drafter) if world_size > 1 else drafter

    @staticmethod
    def _wrap(drafter: torch.nn.Module) -> DDP:
        device = next(drafter.parameters()).device
        # broadcast_buffers=False: the drafter's only buffers are constant RoPE tables; broadcasting
        # them would add a collective to every forward. process_group: the drafter ranks only.
        return DDP(drafter, device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=True, broadcast_buffers=False, process_group=distributed.group())

    def normalizer(self, weight_sums: list[torch.Tensor]) -> torch.Tensor:
        """The step's GLOBAL loss normaliser, from this rank's micro-batches' weight sums: their sum
        over every drafter rank, over the world size since DDP averages gradients over ranks. Any
        split of a batch (ranks x micro-batches x anchor slices) then gives the same gradient."""
        return distributed.all_reduce(torch.stack(weight_sums).sum(), "sum") / self.world_size

    def accumulating(self, sync: bool):
        """The context of one forward + backward: DDP's ``no_sync`` unless ``sync`` (the step's last
        backward), so that gradients accumulate locally and are all-reduced once per step. It
        covers the forward too: that is where DDP arms its reducer."""
        return self.model.no_sync() if not sync and isinstance(self.model, DDP) else _SYNCING

    def forwarding(self):
        """The context of a forward through ``model``: a collective failure in it (DDP's forward can
        rebuild its gradient buckets, a broadcast) is raised as a CollectiveError naming it."""
        return distributed.collective_errors("DDP forward")

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, which includes DDP's overlapped gradient all-reduce on a step's last
        backward: a dead peer surfaces here, named."""
        with distributed.collective_errors("DDP gradient all-reduce (backward)"):
            loss.backward()

    def step(self, losses_finite: torch.Tensor, stop: int = 0) -> Update:
        """The end of an optimizer step: clip, vote, then the optimizer step unless any rank's step
        was non-finite; zero_grad and the scheduler step either way. ``losses_finite``: this
        rank's losses were finite (device bool); ``stop``: the signal this rank was asked to stop
        by (0: none), carried by the vote."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.clip)
        bad, stop = self._vote(grad_norm, losses_finite, stop)
        if not bad:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return Update(grad_norm, not bad, stop)

    def _vote(self, grad_norm: torch.Tensor, losses_finite: torch.Tensor, signum: int) -> tuple[bool, int]:
        """(whether any rank's step was non-finite, the signal any rank was asked to stop by):
        one all-reduce (max) of both, read once. The step's deliberate host sync: all ranks must
        agree to skip (a local NaN loss need not reach every rank's gradients) and never let a
        non-finite loss or gradient into the weights; and all must stop at the same step. Both
        ride in one tensor, so a multi-node job pays one cross-node round trip per step, not two."""
        bad = ~torch.isfinite(grad_norm) | ~losses_finite
        # on the grad norm's device: an NCCL group takes no host tensors
        votes = torch.stack([bad.to(grad_norm.device, torch.float32),
                             torch.tensor(float(signum), device=grad_norm.device)])
        bad_any, stop = distributed.all_reduce(votes, "max").tolist()
        return bad_any != 0, int(stop)

    def release(self) -> None:
        """Drop the DDP wrapper while the process group is still alive. Call before
        ``distributed.teardown()``: a DDP reducer that outlives the group and is the last owner of
        a gloo group destroys it from its destructor while holding the GIL, and a gloo thread it
        joins waits for the GIL -- the process hangs at exit (seen in ~1 of 3 two-rank CPU runs)."""
        self.model = self.drafter
        gc.collect()
