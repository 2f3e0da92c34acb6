"""The one-GPU check's parts (benchmarks/gpu_checks.sh), one function each, and the tools they share.

    python -m flashdraft.bench.gpu_check PART [PART ...] --job DIR --out DIR [--smoke]

Each part returns a JSON-able dict with ``ok`` (its assertions held) and its figures, written to
OUT/PART.json as soon as the part ends with its ``status``: "pass", "fail", or "skip" when it
could not run here (``skipped`` says why: a missing capability, never a pass). The parts run in
the order given, in this process; the exit status is 0 when every one passed, 1 when one
failed, 3 when none failed but one was skipped. The script runs each part in its own process
under its own time limit, so a timeout loses only that part, and ends with a verdict naming
every part that did not run; the CPU smoke test runs most of them in one process, sparing an
interpreter start (~5 s on a small CPU) per part. The parts:

- ``prepare``: the jobs the others train on, in DIR: a random-weight target at the Qwen3-8B
  widths (hidden 4096, vocab 151,936, 32 / 8 heads of 128, MLP 12,288; 6 layers, so not its
  depth), token shards of exactly S = 1024 and 3072 tokens, and a small target (hidden 1024, 4
  layers, vocab 32,768) with a shard of varied lengths.
- ``trainer_1024`` / ``trainer_3072``: the trainer's own path (Trainer, the config's defaults:
  5 drafter layers, block 16, 512 anchors, fp32 master weights under bf16 autocast) for 2 steps at
  S; the memory plan at the run's own micro-batch (``plan_memory(cfg, seq_len=S)``: its B and S
  must be the run's) against peak ``torch.cuda.max_memory_allocated`` within 15 %; beside it
  ``max_memory_reserved`` and what the process holds outside the allocator (CUDA context, NCCL:
  ``mem_get_info``), which the plan's margin (5 % of the device) must cover ("plan unavailable"
  fails the part).
- ``block_mask``: the flex BlockMask built from the anchors at 16 x 512 anchors x block 16 over
  S = 3072 (dense grid: 1.5G elements): its memory under 64 MiB, and equal to create_block_mask's.
- ``sinks``: the blockwise attention with sinks under bf16 autocast at a norm gain of 3: dq, dk,
  dv and d sink within 2 % of fp64.
- ``deterministic``: two 3-step runs (smoke: 2) with train.deterministic=true, in two processes
  (this one and a fresh one: an exact resume needs two processes to agree): losses and weights
  bit-equal.
- ``flex_compile``: the drafter's compiled flex attention (inductor, dynamic shapes: the
  trainer's first CUDA compile), forward and backward, GQA 32 / 8 heads of 128, bf16, over
  micro-batches of four lengths: outputs and gradients within 2 % of the dense oracle in fp32,
  at most 2 graphs, the first call's compile time. On CPU (smoke) the forward runs eager and the
  backward cannot run (torch has no CPU flex backward): a skip that says so.
- ``graphs``: one run over varied lengths: the graphs dynamo compiled (torch._dynamo counters)
  against the batch shapes it met.
- ``pipeline``: the pipelined trainer's losses against the sequential one's (deterministic mode).

``--smoke``: the same code paths on CPU at toy sizes, in seconds (tests/test_gpu_scripts.py);
there the memory figures are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flashdraft.outputs import write_report


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of tensor storage alive at once among the tensors that ops create inside
    the mode (``peak``), on any device: each op's outputs counted once per storage until the
    last of their Python tensors referring to it is gone. Tensors made before the mode are the
    baseline, not counted. For no-grad code: a storage autograd keeps alive after its Python
    tensors die is not seen."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, Python tensors referring]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]


# ---- sizes ----------------------------------------------------------------------------------------

SEQS = (1024, 3072)  # the trainer parts' sequence lengths (smoke: SMOKE_SEQS)
SMOKE_SEQS = (64, 192)
TRAINER_STEPS = 2  # optimizer steps per trainer part (the peak is reached in the first)
PLAN_TOLERANCE = 0.15  # the memory plan's estimate against the measured peak
MASK_BOUND = 64 * 2**20  # bytes the anchor-built block mask may take at the check's size
SINK_TOLERANCE = 0.02  # sink gradients under bf16 autocast against fp64
GRAPH_LIMIT = 4  # compiled graphs allowed over a run of varied lengths
FLEX_TOLERANCE = 0.02  # bf16 flex attention's output and gradients against the fp32 dense oracle
FLEX_GRAPHS = 2  # graphs one dynamic compile of flex may take for any shapes (tests/test_step_equivalence.py)


def _big(smoke: bool) -> dict:
    """The Qwen3-8B widths (smoke: toy widths), 6 layers."""
    if smoke:
        return dict(vocab=512, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=384)
    return dict(vocab=151936, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate=12288)


def _small(smoke: bool) -> dict:
    if smoke:
        return dict(vocab=512, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=192)
    return dict(vocab=32768, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128, intermediate=3072)


def _device(smoke: bool) -> str:
    if smoke:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("this check needs a GPU (or --smoke for the CPU run at toy sizes)")
    return "cuda"


# ---- the jobs ---------------------------------------------------------------------------------------

def _save_target(path: Path, layers: int, sizes: dict, device: str) -> None:
    from flashdraft.toy import tiny_causal_lm

    sizes = dict(sizes)
    vocab = sizes.pop("vocab")
    with torch.device(device):  # random init on the GPU: seconds, not minutes, at 8B widths
        model = tiny_causal_lm(vocab, "qwen3", num_layers=layers, max_position_embeddings=40960, seed=0,
                               dtype=torch.bfloat16, **sizes)
    model.save_pretrained(path)


def _write_shard(path: Path, lengths, vocab: int, seed: int) -> None:
    from flashdraft.data.shards import write_token_shard

    rng = np.random.default_rng(seed)
    rows = [(rng.integers(0, vocab - 2, n), np.r_[np.zeros(n // 4), np.ones(n - n // 4)]) for n in lengths]
    write_token_shard(path, rows, vocab_size=vocab)


def prepare(job: Path, smoke: bool) -> dict:
    device, big, small = _device(smoke), _big(smoke), _small(smoke)
    _save_target(job / "target8b", 6, big, device)
    for s in SMOKE_SEQS if smoke else SEQS:
        per_step = min(64, 16384 // s)  # the most a step can take (the token budget; the row budget takes fewer)
        _write_shard(job / f"data_{s}", [s] * per_step * (TRAINER_STEPS + 2), big["vocab"], seed=s)
    _save_target(job / "small", 4, small, device)
    rng = np.random.default_rng(0)
    lo, hi = (48, 128) if smoke else (128, 2048)  # 3/4 supervised: over data.min_supervised (32)
    _write_shard(job / "data_varied", rng.integers(lo, hi, 96).tolist(), small["vocab"], seed=1)
    return {"ok": True, "job": str(job)}


class _Enough(Exception):
    """Raised by a step hook to end a run before its final checkpoint (the parts measure, not train)."""


def _overrides(job: Path, target: str, data: str, out: Path, smoke: bool, **extra) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(job / target)
    layers = config.num_hidden_layers
    overrides = {
        "target.path": job / target, "drafter.mask_token_id": config.vocab_size - 1,
        "target.layer_ids": json.dumps(list(range(1, layers))[-5:]), "data.path": job / data,
        "train.output_dir": out, "checkpoint.resume": "never", "train.device": _device(smoke), "train.log_every": 1,
        "checkpoint.save_every": 0, "train.metrics": "[jsonl]",
    }
    if smoke:  # toy work: a few rows per micro-batch on 2 shared CPU cores
        overrides.update({"data.token_budget": 512, "objective.num_anchors": 8, "drafter.num_layers": 1})
    return {**overrides, **extra}


def _config(overrides: dict):
    from flashdraft.config import load_config

    return load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])


def _run(overrides: dict, stop_after: int | None = None, shapes: set | None = None):
    """A Trainer on ``overrides``, fitted; ``stop_after`` steps: ended by a hook before the final
    checkpoint (which at 8B widths would write 17 GB); ``shapes`` collects (B, S, anchors) of every
    drafter forward. Returns the trainer."""
    from flashdraft.train.trainer import Trainer

    trainer = Trainer(_config(overrides))
    if shapes is not None:
        trainer.drafter.register_forward_pre_hook(lambda module, args: shapes.add((*args[0].shape[:2],
                                                                                   args[2].shape[1])))

    def on_step(t):
        if stop_after is not None and t.step >= stop_after:
            raise _Enough

    with trainer:
        try:
            trainer.fit(on_step=on_step)
        except _Enough:
            pass
    return trainer


# ---- the parts ----------------------------------------------------------------------------------------

def plan_at(config, seq: int):
    """The memory plan (flashdraft.train.plan.plan_memory) at padded length ``seq``: the run's own
    micro-batch, not the worst one; (None, why) when it cannot be made."""
    try:
        from flashdraft.train.plan import plan_memory
    except ImportError as exc:
        return None, f"plan unavailable ({exc})"
    return plan_memory(config, seq_len=seq), ""


def trainer_path(job: Path, seq: int, smoke: bool) -> dict:
    """The trainer's path at S = ``seq`` with the defaults: the measured peak (allocated, and
    reserved plus what the allocator does not see) against the plan of the same micro-batch."""
    from flashdraft.train.plan import MemoryPlan

    seq = SMOKE_SEQS[SEQS.index(seq)] if smoke else seq
    with tempfile.TemporaryDirectory() as out:
        overrides = _overrides(job, "target8b", f"data_{seq}", Path(out), smoke, **{"train.max_steps": 100})
        plan, why = plan_at(_config(overrides), seq)
        cuda = not smoke
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        result = {"seq": seq, "plan_peak_gib": None if plan is None else plan.peak_bytes / 2**30,
                  "plan_micro_batch": None if plan is None else [plan.batch_size, plan.seq_len]}
        shapes = set()
        try:
            t0 = time.perf_counter()
            trainer = _run(overrides, TRAINER_STEPS, shapes)
            result["seconds"] = time.perf_counter() - t0
            result["drafter_inputs"] = sorted(shapes)  # (B, S, anchors per sequence)
            result["losses"] = [h["loss"] for h in trainer.history if "loss" in h]
        except torch.OutOfMemoryError as exc:
            result.update(oom=True, error=f"OutOfMemoryError: {str(exc).splitlines()[0]}")
        if cuda:  # before the trainer's memory goes back: the allocator's reserve and the rest of the process
            free, total = torch.cuda.mem_get_info()
            result.update(measured_peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                          reserved_peak_gib=torch.cuda.max_memory_reserved() / 2**30,
                          outside_allocator_gib=(total - free - torch.cuda.memory_reserved()) / 2**30,
                          device_gib=total / 2**30)
    if plan is None:
        return {**result, "ok": False, "plan": why}
    # the plan must describe the run it is compared with: every micro-batch of the run is the plan's
    result["same_micro_batch"] = bool(shapes) and all([b, s] == result["plan_micro_batch"] for b, s, _ in shapes)
    ok = "oom" not in result and result["same_micro_batch"]
    if not cuda:  # smoke: the comparison's code path, not its figures
        return {**result, "ok": ok, "plan_ratio": None}
    ratio = result["measured_peak_gib"] / result["plan_peak_gib"]
    # what the margin kept free is for: the allocator's reserve beyond what it hands out, and the
    # process's memory outside it (CUDA context, NCCL buffers)
    beyond = result["reserved_peak_gib"] - result["measured_peak_gib"] + result["outside_allocator_gib"]
    margin = MemoryPlan.MARGIN * result["device_gib"]
    result.update(plan_ratio=ratio, beyond_allocated_gib=beyond, margin_gib=margin, margin_covers=beyond <= margin)
    return {**result, "ok": ok and abs(ratio - 1) <= PLAN_TOLERANCE and beyond <= margin}


def block_mask_memory(smoke: bool) -> dict:
    """The anchor-built BlockMask of a real micro-batch: its memory, and equal to create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashdraft.config import LayerMask
    from flashdraft.drafter.attention import flex_block_mask, flex_mask_mod

    device = _device(smoke)
    b, n, bs, s = (2, 64, 16, 256) if smoke else (16, 512, 16, 3072)
    g = torch.Generator().manual_seed(0)
    anchors = torch.stack([torch.randperm(s - 1, generator=g)[:n].sort().values + 1 for _ in range(b)]).to(device)
    valid = torch.ones(b, n, dtype=torch.bool, device=device)
    result = {"batch": b, "anchors": n, "seq": s, "dense_grid_elements": b * n * bs * (s + n * bs)}
    for name, layer in (("full", LayerMask()), ("sliding_2048", LayerMask(window=2048, causal=True))):
        peak, _ = _peak_bytes(lambda: flex_block_mask(anchors, valid, s, bs, layer), device)  # noqa: B023
        result[f"{name}_mib"] = peak / 2**20
    # the same mask the dense way, on two sequences (~2 GiB at the real size)
    few, few_valid = anchors[:2], valid[:2]
    got = flex_block_mask(few, few_valid, s, bs)
    dense_peak, ref = _peak_bytes(lambda: create_block_mask(flex_mask_mod(few, few_valid, s, bs), 2, None, n * bs,
                                                            s + n * bs, device=device), device)
    result["dense_two_sequences_mib"] = dense_peak / 2**20
    result["equal"] = all(torch.equal(x, y) for x, y in zip(got.as_tuple()[2:10], ref.as_tuple()[2:10]))
    result["ok"] = result["equal"] and max(result["full_mib"], result["sliding_2048_mib"]) < MASK_BOUND / 2**20
    return result


def _peak_bytes(fn, device: str):
    """(peak bytes allocated while ``fn`` runs, beyond what was allocated before, its result)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out
    with LiveTensorBytes() as tracked:
        out = fn()
    return tracked.peak, out


def sink_gradient_errors(device: str, s: int, n: int, heads: int, kv_heads: int, head_dim: int, gain: float = 3.0,
                         block_size: int = 16, seed: int = 0) -> dict:
    """Relative errors (norm of the difference / norm of fp64's) of dq, dk, dv (context and
    block) and d sink of the blockwise attention with sinks under bf16 autocast, q and k at a
    norm gain of ``gain``, against the dense oracle in fp64."""
    from flashdraft.drafter.attention import attend, attention_plan

    g = torch.Generator().manual_seed(seed)
    anchors = (torch.randperm(s - 1, generator=g)[:n].sort().values.view(1, n) + 1).to(device)
    valid = torch.ones(1, n, dtype=torch.bool, device=device)
    q_rows = n * block_size
    shapes = ((heads, q_rows, gain), (kv_heads, s, gain), (kv_heads, s, 1.0), (kv_heads, q_rows, gain),
              (kv_heads, q_rows, 1.0))
    tensors = [torch.randn(1, h, rows, head_dim, generator=g) * scale for h, rows, scale in shapes]
    sink0, upstream = torch.randn(heads, generator=g), torch.randn(1, heads, q_rows, head_dim, generator=g)
    grads = {}
    for dtype in (torch.float64, torch.float32):
        leaves = [t.to(device, dtype).requires_grad_() for t in (*tensors, sink0)]
        q, kc, vc, kb, vb, sink = leaves
        if dtype == torch.float64:
            kc, vc, kb, vb = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kc, vc, kb, vb))
            out = attend(q, kb, vb, kc, vc, attention_plan("dense", anchors, valid, s, block_size), sink)
        else:
            with torch.autocast(device, dtype=torch.bfloat16):
                plan = attention_plan("blockwise", anchors, valid, s, block_size, dtype=torch.bfloat16)
                out = attend(q, kb, vb, kc, vc, plan, sink)
        (out.double() * upstream.to(device, torch.float64)).sum().backward()
        grads[dtype] = [t.grad.double() for t in leaves]
    names = ("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk", "dsink")
    return {name: float((a - b).norm() / b.norm()) for name, a, b in zip(names, grads[torch.float32],
                                                                           grads[torch.float64])}


def sinks(smoke: bool) -> dict:
    device = _device(smoke)
    size = dict(s=512, n=16, heads=4, kv_heads=2, head_dim=64) if smoke else \
        dict(s=3072, n=64, heads=32, kv_heads=8, head_dim=128)
    errors = sink_gradient_errors(device, **size)
    return {**size, "gain": 3.0, "errors": errors, "ok": max(errors.values()) < SINK_TOLERANCE}


def _weights(trainer) -> dict:
    return {k: v.detach().cpu().clone() for k, v in trainer.drafter.state_dict().items()}


def deterministic_run(job: Path, smoke: bool, out: str | None = None) -> dict:
    """One run of the ``deterministic`` part: its losses and a sha256 of every weight (written to
    ``out`` as JSON when given: the part's second process)."""
    import hashlib

    steps = 2 if smoke else 3
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = _run(_overrides(Path(job), "small", "data_varied", Path(run_dir), smoke, **{
            "train.max_steps": steps, "train.deterministic": "true"}))
        found = {"losses": [h["loss"] for h in trainer.history if "loss" in h],
                 "weights": {k: hashlib.sha256(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                                               .numpy()).hexdigest() for k, v in trainer.drafter.state_dict().items()}}
    if out is not None:
        Path(out).write_text(json.dumps(found))
    return found


def deterministic(job: Path, smoke: bool) -> dict:
    """Two runs with train.deterministic=true, one here and one in a fresh process (spawned: its
    own CUDA context, kernels and allocator): the same losses and weights, bit for bit."""
    import multiprocessing

    mine = deterministic_run(job, smoke)
    with tempfile.TemporaryDirectory() as tmp:
        child = multiprocessing.get_context("spawn").Process(target=deterministic_run,
                                                             args=(str(job), smoke, f"{tmp}/run.json"))
        child.start()
        child.join()
        if child.exitcode != 0:
            return {"ok": False, "error": f"the second process exited with status {child.exitcode}"}
        other = json.loads(Path(f"{tmp}/run.json").read_text())
    steps = 2 if smoke else 3
    same_weights = mine["weights"] == other["weights"]
    return {"losses": [mine["losses"], other["losses"]], "losses_equal": mine["losses"] == other["losses"],
            "weights_equal": same_weights, "processes": 2,
            "ok": mine["losses"] == other["losses"] and same_weights and len(mine["losses"]) == steps}


def flex_compile(smoke: bool) -> dict:
    """The drafter's flex attention as the trainer runs it (drafter.attention.attend with a flex
    plan: on CUDA compiled once, with dynamic shapes), forward and backward over micro-batches of
    different lengths, against the dense oracle in fp32. CPU: the forward runs eager, and torch
    has no CPU backward for flex -- the part is a skip that names it."""
    from torch._dynamo.utils import counters

    from flashdraft.drafter.attention import BlockAttentionPlan, attend, attention_plan, flex_block_mask

    device = _device(smoke)
    heads, kv_heads, dim, bs = (4, 2, 16, 4) if smoke else (32, 8, 128, 16)
    # (B, S, anchors); B never 1: dynamo specialises a size of 1, a recompile the trainer's B can avoid
    shapes = [(2, 96, 8), (2, 150, 8), (3, 64, 6), (2, 41, 5)] if smoke else \
        [(2, 1024, 64), (2, 2000, 64), (3, 3072, 128), (2, 517, 32)]
    graphs_before = counters["stats"].get("unique_graphs", 0)
    calls, skipped = [], ""
    for b, s, n in shapes:
        g = torch.Generator().manual_seed(s)
        anchors = torch.stack([torch.randperm(s - 1, generator=g)[:n].sort().values + 1 for _ in range(b)]).to(device)
        valid = torch.ones(b, n, dtype=torch.bool, device=device)
        sizes = [(heads, n * bs), (kv_heads, n * bs), (kv_heads, n * bs), (kv_heads, s), (kv_heads, s)]
        inputs = [torch.randn(b, h, rows, dim, generator=g) for h, rows in sizes]  # q, k_blk, v_blk, k_ctx, v_ctx
        upstream = torch.randn(b, heads, n * bs, dim, generator=g).to(device)
        ref = [t.to(device).detach().requires_grad_() for t in inputs]
        ref_out = attend(*ref, attention_plan("dense", anchors, valid, s, bs))
        (ref_out * upstream).sum().backward()
        leaves = [t.to(device, torch.bfloat16).detach().requires_grad_() for t in inputs]
        flex = BlockAttentionPlan("flex", block_mask=flex_block_mask(anchors, valid, s, bs))  # never resolved away
        t0 = time.perf_counter()
        try:
            out = attend(*leaves, flex)
            (out.float() * upstream).sum().backward()
        except NotImplementedError as exc:  # torch's own refusal (CPU): a capability this machine lacks
            if device == "cuda":
                raise
            skipped = f"flex attention's backward does not run on CPU (torch {torch.__version__}: {exc})"
            with torch.no_grad():  # the forward alone
                out = attend(*[t.detach() for t in leaves], flex)
        else:
            call_grads = [_relative(x.grad, r.grad) for x, r in zip(leaves, ref)]
        call = {"shape": [b, s, n], "out_error": _relative(out.detach(), ref_out.detach())}
        if not skipped:
            call["grad_errors"] = call_grads
        if device == "cuda":
            torch.cuda.synchronize()
        call["seconds"] = time.perf_counter() - t0  # the first call's holds the compile
        calls.append(call)
    graphs = counters["stats"].get("unique_graphs", 0) - graphs_before
    worst = max(max([c["out_error"], *c.get("grad_errors", [])]) for c in calls)
    result = {"calls": calls, "compiled_graphs": graphs, "worst_error": worst, "tolerance": FLEX_TOLERANCE,
              "first_call_seconds": calls[0]["seconds"]}
    if skipped:
        return {**result, "ok": worst <= FLEX_TOLERANCE, "skipped": skipped}
    return {**result, "ok": worst <= FLEX_TOLERANCE and 1 <= graphs <= FLEX_GRAPHS}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius norms, in fp64)."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


def graphs(job: Path, smoke: bool) -> dict:
    """One run over varied lengths: dynamo's compiled graphs against the distinct batch shapes."""
    from torch._dynamo.utils import counters

    shapes = set()
    steps = 3 if smoke else 8
    before = dict(counters["stats"])
    with tempfile.TemporaryDirectory() as out:
        _run(_overrides(job, "small", "data_varied", Path(out), smoke, **{"train.max_steps": steps}), shapes=shapes)
    compiled = counters["stats"].get("unique_graphs", 0) - before.get("unique_graphs", 0)
    seqs = sorted({s for _, s, _ in shapes})
    expected_some = not smoke  # CUDA compiles flex; CPU trains blockwise, nothing compiled
    return {"steps": steps, "batch_shapes": sorted(shapes), "distinct_lengths": len(seqs), "compiled_graphs": compiled,
            "recompiles": dict(counters["recompiles"]), "limit": GRAPH_LIMIT,
            "ok": compiled <= GRAPH_LIMIT and (compiled >= 1 or not expected_some) and len(seqs) >= 2}


def pipeline(job: Path, smoke: bool) -> dict:
    """The pipelined trainer's losses against the sequential trainer's (deterministic mode)."""
    losses, steps = {}, 3 if smoke else 6
    for enabled in (False, True):
        with tempfile.TemporaryDirectory() as out:
            trainer = _run(_overrides(job, "small", "data_varied", Path(out), smoke, **{
                "train.max_steps": steps, "train.deterministic": "true", "pipeline.enabled": str(enabled).lower()}))
            losses["pipelined" if enabled else "sequential"] = [h["loss"] for h in trainer.history if "loss" in h]
            del trainer
    seq, pipe = losses["sequential"], losses["pipelined"]
    diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(seq, pipe)), default=float("inf"))
    return {**losses, "max_relative_diff": diff, "bit_equal": seq == pipe,
            "ok": len(seq) == len(pipe) == steps and diff <= 1e-6}


PARTS = {
    "prepare": lambda job, smoke: prepare(job, smoke),
    "trainer_1024": lambda job, smoke: trainer_path(job, 1024, smoke),
    "trainer_3072": lambda job, smoke: trainer_path(job, 3072, smoke),
    "block_mask": lambda job, smoke: block_mask_memory(smoke),
    "sinks": lambda job, smoke: sinks(smoke),
    "deterministic": deterministic,
    "graphs": graphs,
    "pipeline": pipeline,
    "flex_compile": lambda job, smoke: flex_compile(smoke),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("parts", nargs="+", choices=list(PARTS), metavar="PART",
                        help=f"the parts to run, in order: {', '.join(PARTS)}")
    parser.add_argument("--job", required=True, help="the jobs' directory (written by the prepare part)")
    parser.add_argument("--out", required=True, help="the results' directory: OUT/PART.json for each part")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy sizes")


def run(args) -> int:
    """Each part in turn; 0 when every one passed, 1 when one failed, 3 when none failed but one
    was skipped (it could not run here)."""
    statuses = [run_part(part, Path(args.job), Path(args.out), args.smoke) for part in args.parts]
    return 1 if "fail" in statuses else 3 if "skip" in statuses else 0


def run_part(part: str, job: Path, out: Path, smoke: bool) -> str:
    """One part: its JSON written to OUT/PART.json whatever happens inside; its status: "pass",
    "fail", or "skip" (a part that could not run here says why in ``skipped``; its checks that
    did run must have held, else it fails)."""
    result = {"part": part, "smoke": smoke, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not smoke else "cpu"}
    t0 = time.perf_counter()
    try:
        result.update(PARTS[part](job, smoke))
    except Exception as exc:  # the part fails, the JSON says why, the other parts go on
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    result["wall_s"] = time.perf_counter() - t0
    result["status"] = "fail" if not result["ok"] else "skip" if result.get("skipped") else "pass"
    out.mkdir(parents=True, exist_ok=True)
    write_report(out / f"{part}.json", json.dumps(result, indent=1, default=str), flag="--out")
    brief = {k: v for k, v in result.items() if k not in ("traceback", "torch", "device", "status")}
    print(f"{part}: {result['status'].upper()} {json.dumps(brief, default=str)[:1500]}",
          flush=True)
    return result["status"]


if __name__ == "__main__":  # what benchmarks/gpu_checks.sh runs (`flashdraft bench gpu-check` is the same)
    parser = argparse.ArgumentParser(prog="python -m flashdraft.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
