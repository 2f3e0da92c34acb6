"""A clock for every wait (flashdraft.distributed.Clocks): runs with
train.collective_timeout_s=3, paced to last many times that -- slow steps, slow checkpoint
writes, slow evals, drafter ranks sending their HELLO late --
end cleanly and train exactly what their unpaced runs train (test_equivalence.py's layouts).
Before, each died after 3 s: a receive posted for the whole run timed out on the collective
clock and closed every connection of the control group, and the ranks' checkpoint and eval
barriers, a target rank's sends while its drafter ranks saved, a target group's gather after
loading and its wait for the HELLOs all sat on the collective timeout."""

from __future__ import annotations

import json
import time

import torch

from conftest import final_drafter, overrides, read_log, run_ranks
from test_equivalence import DISAGGREGATED, LAYOUTS

TIMEOUT_S = 3  # train.collective_timeout_s of the paced runs
PAUSE_S = 3.6  # each injected pause outlasts it
STEPS = {"FLASHDRAFT_TEST_STEP_SLEEP": "0.3"}
SLOW_WRITES = {"FLASHDRAFT_TEST_WRITE_SLEEP": str(PAUSE_S / 4)}  # a save writes 4 parts


def _losses(out) -> dict[int, float]:
    records = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _paced_run(forkserver, args: list[str], world_size: int, env: dict) -> float:
    """`flashdraft train ARGS` on ``world_size`` ranks paced by ``env``: every rank must exit 0.
    Returns the wall time."""
    started = time.monotonic()
    workers = run_ranks(forkserver, "cli", "train", *args, world_size=world_size, timeout=240, env=env)
    elapsed = time.monotonic() - started
    codes = [forkserver.wait(pid, 0) for pid, _ in workers]
    assert codes == [0] * world_size, "\n".join(read_log(log)[-3000:] for _, log in workers)
    return elapsed


def _same_training(out, unpaced_out) -> None:
    assert _losses(out) == _losses(unpaced_out)
    step, weights = final_drafter(out)
    unpaced_step, unpaced = final_drafter(unpaced_out)
    assert step == unpaced_step
    for name, value in unpaced.items():
        assert torch.equal(weights[name], value), name


def test_a_disaggregated_run_outlives_its_collective_timeout_and_trains_what_the_unpaced_run_trains(
        tiny_job, tmp_path, forkserver, references):
    """1 target rank feeding 2 drafter ranks for 8 steps of 0.3 s, with a 3.6 s eval on drafter
    rank 0 after steps 4 and 8: drafter rank 1 waits for it at the eval's barrier (the pause
    clock), the target rank's sends wait for the drafter ranks (the link clock), and its receive
    of each drafter rank's DONE stays posted throughout (the watch clock)."""
    unpaced = LAYOUTS["disaggregated_1_target_2_drafters"].run.of(references).out
    out = tmp_path / "run"
    args = overrides(tiny_job, out, **{**DISAGGREGATED, "train__max_steps": 8, "train__collective_timeout_s": TIMEOUT_S,
                                       "eval__every": 4, "eval__prompts_path": tiny_job / "prompts.jsonl",
                                       "eval__num_prompts": 2, "eval__max_new_tokens": 8})
    elapsed = _paced_run(forkserver, args, 3, {**STEPS, "FLASHDRAFT_TEST_EVAL_SLEEP": str(PAUSE_S)})
    assert elapsed > 3 * TIMEOUT_S  # the paced run outlived its collective timeout many times over
    _same_training(out, unpaced)
    assert (out / "metrics.jsonl").read_text().count('"eval_tau":') == 2  # both evals ran, and were waited for


def test_a_tensor_parallel_target_group_outlives_its_collective_timeout_and_trains_what_the_unpaced_run_trains(
        tiny_job, tmp_path, forkserver, references):
    """Ranks 2 and 3, one target group of 2, feed drafter ranks 0 and 1: the drafter ranks send
    their HELLOs 3.6 s late (rank 3 waits for rank 2 to pass them on: the start-up clock, at a
    host-side barrier), and a 3.6 s checkpoint after step 3 holds rank 2's sends (the link
    clock), and with them rank 3's next collective in the group (the group's mesh: the link
    clock too). A sharded target loaded late: test_multinode.py."""
    layout = LAYOUTS["disaggregated_from_a_tp2_group"]
    unpaced = layout.run.of(references).out
    out = tmp_path / "run"
    args = overrides(tiny_job, out, **{**layout.run.knobs, "checkpoint__save_every": 3,
                                       "train__collective_timeout_s": TIMEOUT_S})
    elapsed = _paced_run(forkserver, args, 4, {**STEPS, **SLOW_WRITES, "FLASHDRAFT_TEST_HELLO_SLEEP": str(PAUSE_S)})
    assert elapsed > 3 * TIMEOUT_S
    _same_training(out, unpaced)


def test_a_checkpoint_written_slower_than_the_collective_timeout_is_waited_for(tiny_job, tmp_path, forkserver,
                                                                               references):
    """2 colocated ranks save after steps 3 and 6, each save taking 3.6 s on rank 0: rank 1 waits
    for it at the end-of-save barrier (the pause clock), and both go on to train what the
    unpaced 2-rank run trains."""
    unpaced = references(2).out
    out = tmp_path / "run"
    args = overrides(tiny_job, out, checkpoint__save_every=3, train__collective_timeout_s=TIMEOUT_S)
    elapsed = _paced_run(forkserver, args, 2, {**STEPS, **SLOW_WRITES})
    assert elapsed > 2 * TIMEOUT_S
    _same_training(out, unpaced)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000006"]
