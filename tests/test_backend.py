"""The backend (train/backend.py), on its own: the step's end in one process (clip, vote, optimizer,
scheduler), and on two gloo ranks the global normaliser, DDP's once-per-step gradient sync and
the vote that skips or stops every rank together."""

from __future__ import annotations

import torch

from conftest import make_drafter, results, run_ranks
from flashdraft.config import ObjectiveConfig
from flashdraft.objective import make_blocks
from flashdraft.train.backend import Backend
from flashdraft.train.step import forward_backward
from flashdraft.train.strategy import strategy_for


def one_process(target, clip: float = 0.0, lr: float = 1.0):
    """A drafter, a plain-SGD backend (an applied update is -lr x the clipped gradient) and its
    strategy; the gradients of one micro-batch accumulated."""
    drafter = make_drafter(target, block_size=4).train()
    optimizer = torch.optim.SGD(drafter.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    backend = Backend(drafter, optimizer, scheduler, grad_clip=clip)
    strategy = strategy_for(drafter, target, ObjectiveConfig(num_anchors=6))
    ids = torch.randint(0, 299, (2, 32), generator=torch.Generator().manual_seed(0))
    blocks = make_blocks(ids, torch.ones_like(ids), torch.full((2,), 32), block_size=4, mask_token_id=299,
                         num_anchors=6, gamma=None, seed=0)
    with torch.no_grad():
        features = target.features(ids, torch.ones_like(ids))
    outs = forward_backward(strategy, backend, features, blocks)
    return drafter, backend, optimizer, outs


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def test_one_process_runs_the_bare_drafter_and_its_normaliser_is_the_local_sum(target):
    drafter, backend, _, _ = one_process(target)
    assert backend.model is drafter
    with backend.accumulating(False), backend.accumulating(True):  # nothing to hold back without DDP
        pass
    assert backend.normalizer([torch.tensor(2.0), torch.tensor(3.5)]) == 5.5


def test_an_update_is_clipped_then_applied_and_the_schedule_moves_on(target):
    drafter, backend, optimizer, _ = one_process(target, clip=1e-3, lr=100.0)  # a step well above rounding
    before, grads = flat(drafter.parameters()), flat(p.grad for p in drafter.parameters())
    update = backend.step(torch.tensor(True))
    assert update.applied and update.stop == 0
    torch.testing.assert_close(update.grad_norm, grads.norm())  # the norm before clipping
    assert grads.norm() > 1e-2
    step = before - flat(drafter.parameters())
    torch.testing.assert_close(step, 100.0 * grads * (1e-3 / grads.norm()), rtol=1e-3, atol=1e-6)
    assert all(p.grad is None for p in drafter.parameters())
    assert optimizer.param_groups[0]["lr"] == 50.0  # the scheduler stepped


def test_a_non_finite_loss_or_gradient_skips_the_update_but_not_the_schedule(target):
    for case in ("loss", "gradient"):
        drafter, backend, optimizer, outs = one_process(target)
        if case == "gradient":
            next(drafter.parameters()).grad[0] = float("inf")
        losses_finite = torch.tensor(case != "loss") & torch.isfinite(outs[0].terms_total)
        before = flat(drafter.parameters())
        update = backend.step(losses_finite, stop=15)
        assert not update.applied and update.stop == 15, case
        assert torch.equal(flat(drafter.parameters()), before), case
        assert all(p.grad is None for p in drafter.parameters()), case
        assert optimizer.param_groups[0]["lr"] == 0.5, case
    assert not torch.isfinite(update.grad_norm)


def test_two_ranks_agree_on_the_normaliser_sync_once_per_step_and_vote_together(forkserver):
    """tests/_workers.py backend_ranks: a DDP-wrapped drafter on 2 gloo ranks, each with its own data."""
    r0, r1 = results(run_ranks(forkserver, "backend_ranks", world_size=2, timeout=120))
    assert r0["ddp"] and r1["ddp"]
    assert r0["normalizer"] == r1["normalizer"] == (1 + 10 + 2 + 10) / 2  # over every rank, / world size
    assert r0["local"] != r1["local"]  # accumulating(sync=False): each rank kept its own gradients
    assert r0["synced"] == r1["synced"]  # the step's last backward averaged them once ...
    assert r0["synced_is_the_ranks_mean"] and r1["synced_is_the_ranks_mean"]  # ... over both micro-batches
    # rank 1's loss was non-finite, rank 0 asked to stop: both ranks skip, both stop
    assert [r["skipped"] for r in (r0, r1)] == [{"applied": False, "stop": 15, "unchanged": True}] * 2
    assert r0["applied"] == r1["applied"] == {"applied": True, "stop": 0, "unchanged": False}
    assert r0["weights"] == r1["weights"]
