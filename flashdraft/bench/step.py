"""`flashdraft bench step`: forward + backward time and peak memory of the drafter step.

The drafter step is everything after the target forward: fusion, the drafter layers over
N anchored blocks, the target's LM head and the weighted CE, and their backward. What is
timed is the trainer's own micro-step, ``flashdraft.train.step.forward_backward`` (block
embedding included), so the figures describe training. Two variants run side by side on
identical weights and inputs:

- ``fast``: the drafter's per-device attention (``auto``: "blockwise" on CPU, block-sparse
  flex_attention on CUDA), the chunked LM head + CE (``--chunk`` slots), slot 0 skipped in
  the last layer and the head, layer 0 on the distinct rows (anchors + MASK), the last
  layer's attention probabilities kept for its backward, and the lean custom-backward
  RMSNorm / RoPE / SwiGLU.
- ``dflash2``: the fast step of a DFlash2 drafter at the same shapes: the grouped dynamic
  convolution around every sublayer (every row computed: it mixes each slot with the ones
  before it) and the selector term over the head's top-k candidates (``--selector-top-k``),
  so that its cost reads next to the v1 ``fast`` step.
- ``kd``: the fast step with soft labels (``--kd-weight``, 0.5 when that is 0): the features end in
  the target's final states [B, S, H] and the chunked head computes the target's distribution
  next to the drafter's, so that KD's time and peak memory read against the CE step's.
- ``reference``: the straightforward step, the tests' oracle: one SDPA over keys
  [context | all N*bs slots] with the dense [N*bs, S + N*bs] mask, every slot of every block
  computed (slot 0 too), the unchunked LM head + autograd CE, and transformers' stock
  RMSNorm / RoPE / MLP under autograd (``DFlashDrafter(lean=False)``); the step's oracle
  switches (``Strategy.drafter_forward``'s ``scored_only=False, distinct_rows=False``).

The objective: decay weights and CE by default; ``--weighting dpace``, ``--auf`` (accept-until-fail)
and ``--kd-weight`` (soft labels: the features then end in the target's final states [B, S, H], and
the chunked head computes the target's distribution next to the drafter's) set what the trainer's
objective keys set, so that a KD step's time and peak memory read against the CE step's at the same
point (docs/benchmarks.md).

Precision (``--precision``): ``trainer`` (the default) is how the trainer runs on CUDA: fp32
master weights under bf16 autocast, the target's features, embeddings and LM head in bf16;
``bf16`` puts the drafter's weights in bf16 too, without autocast (what this benchmark measured
before; the serving dtype); ``fp32`` is the CPU trainer's default, all fp32.

Time: min over ``--repeat`` steps after a warm-up, the variants built in one process and
stepped alternately (the min is robust to other processes on a shared host). Memory: every
(point, variant) runs in a process of its own, all of them before any timing: one warm-up
step, then the peak extra memory of the next step. On CUDA that process is a fresh interpreter
(CUDA cannot be forked once initialised); on CPU it is a fork of this process: the same clean
high-water mark without the ~5 s of imports a fresh interpreter pays on a small CPU, measured
on one thread (a fork cannot use the OpenMP threads of a parent that ran parallel ops).
On CPU the figure is the RSS high-water mark (``VmHWM``, reset through
/proc/self/clear_refs) minus the RSS just before the step, with glibc's mmap threshold fixed
at 64 KiB so that freed tensors go back to the OS and RSS follows the live tensors (without
it glibc keeps freed memory and the figure depends on what an earlier step left behind); the
warm-up keeps one-off costs (library pages, thread pools) out. On CUDA it is
``torch.cuda.max_memory_allocated`` minus the allocation before the step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

# at module level (the CLI imports this module only for `flashdraft bench step`): the memory
# forks (run_point) then start with everything a step needs already imported
from flashdraft.config import ObjectiveConfig
from flashdraft.drafter import DFlashDrafter, drafter_config_from_target
from flashdraft.drafter.dflash2 import DFlash2Modules
from flashdraft.objective import Blocks, SelectorLoss, SlotLoss, block_labels_and_weights, default_gamma
from flashdraft.toy import causal_lm_config
from flashdraft.train.backend import Backend
from flashdraft.train.step import forward_backward
from flashdraft.train.strategy import strategy_for

# --precision -> (the step's low-precision dtype, autocast): the drafter's weights are fp32 under
# autocast, else in that dtype; the target's features, embeddings and LM head always in it.
PRECISIONS = {"trainer": ("bfloat16", True), "bf16": ("bfloat16", False), "fp32": ("float32", False)}


def resolve_precision(args) -> str:
    """--precision, or what the older --dtype / --autocast spelled (default: trainer)."""
    if args.precision is not None:
        return args.precision
    if args.dtype is None:
        return "trainer"
    if args.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--dtype {args.dtype!r}: use bfloat16 or float32 (or --precision trainer|bf16|fp32)")
    if args.autocast:
        return "trainer" if args.dtype == "bfloat16" else "fp32"
    return "bf16" if args.dtype == "bfloat16" else "fp32"


DEFAULT_GRID = {
    # (seq, anchors, hidden): the S sweep, the num_anchors sweep, the hidden sweep.
    "seq": [(512, 128, 256), (1024, 128, 256), (2048, 128, 256), (3072, 128, 256)],
    "anchors": [(1024, 32, 256), (1024, 64, 256), (1024, 128, 256), (1024, 256, 256), (1024, 512, 256)],
    "hidden": [(1024, 128, 128), (1024, 128, 512)],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, help="sequence length S (single point; default: the grid)")
    parser.add_argument("--hidden", type=int, help="hidden size (head_dim 64, 4 query heads per KV head)")
    parser.add_argument("--layers", type=int, default=2, help="drafter layers")
    parser.add_argument("--anchors", type=int, help="anchored blocks per sequence")
    parser.add_argument("--block", type=int, default=16, help="block size")
    parser.add_argument("--vocab", type=int, default=4096, help="LM-head vocabulary size")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--taps", type=int, default=5, help="tapped target layers (fc input = taps * hidden)")
    parser.add_argument("--chunk", type=int, default=256, help="fast path: LM-head + CE chunk (slots)")
    parser.add_argument("--anchors-per-microbatch", type=int, default=0, help="fast path: anchor slice (0: all)")
    parser.add_argument("--checkpointing", action="store_true", help="fast path: activation checkpointing")
    parser.add_argument("--attention", default="auto", help="fast path attention: auto, split, flex")
    parser.add_argument("--variants", default="fast,reference", help="comma list of fast, reference, dflash2, kd")
    parser.add_argument("--conv-kernel-size", type=int, default=2, help="dflash2 variant: the conv's taps")
    parser.add_argument("--conv-group-size", type=int, default=16, help="dflash2 variant: channels per kernel")
    parser.add_argument("--selector-rank", type=int, default=256, help="dflash2 variant: the selector's rank")
    parser.add_argument("--selector-top-k", type=int, default=16, help="dflash2 variant: candidates per slot")
    parser.add_argument("--sweeps", default="seq,anchors,hidden", help="grid mode: comma list of seq, anchors, hidden")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per point (after 1 warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="trainer (default): fp32 drafter weights under bf16 autocast, as the trainer runs on "
                             "CUDA; bf16: bf16 weights, no autocast; fp32: all fp32 (the CPU trainer's default)")
    parser.add_argument("--dtype", default=None,
                        help="older spelling: bfloat16 (--precision bf16, or trainer with --autocast) or float32")
    parser.add_argument("--autocast", action="store_true", help="with --dtype bfloat16: --precision trainer")
    parser.add_argument("--head-dim", type=int, default=64, help="attention head dim (Qwen3-8B: 128)")
    parser.add_argument("--intermediate", type=int, default=0, help="MLP size (0: 3 * hidden, as Qwen3-8B)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="device peak (TFLOP/s, dense, this dtype) to report the share of; 0: do not")
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="> 0: every drafter layer sliding-window (causal in-block) with this window")
    parser.add_argument("--weighting", default="decay", help="slot weights: decay or dpace (objective.weighting)")
    parser.add_argument("--kd-weight", type=float, default=0.0,
                        help="soft labels (objective.kd_weight) in every variant: > 0 adds the target's final states "
                             "[B, S, H] to the features and mixes the KL from its distribution into each slot's loss "
                             "(0: CE only; the kd variant: 0.5)")
    parser.add_argument("--kd-temperature", type=float, default=1.0, help="soft labels: objective.kd_temperature")
    parser.add_argument("--auf", action="store_true",
                        help="accept-until-fail weights (objective.accept_until_fail, auf_factor 0)")
    parser.add_argument("--json", default="", help="also write all results to this JSON file")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)  # internal: one point, JSON in


class Heads(torch.nn.Module):
    """The two parts of a target the drafter step uses, frozen: the input embedding (``embed``)
    and the LM head (``lm_head``), as TargetModel exposes them."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        # built on the meta device: its own [V, H] weight would be allocated only to be replaced
        self.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
        self.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)


def build(point: dict):
    """Drafter, frozen target heads and one micro-batch's inputs for ``point`` (deterministic).
    The target is only a Qwen3 config (the drafter's shapes follow it); its features, embeddings
    and LM head are random tensors, so a Qwen3-8B-sized point needs no 8B weights."""

    device, dtype = torch.device(point["device"]), getattr(torch, point["dtype"])
    hidden, seq, n, bs, vocab, b = (point["hidden"], point["seq"], point["anchors"], point["block"], point["vocab"],
                                    point["batch"])
    heads = max(1, hidden // point.get("head_dim", 64))
    kv_heads = max(1, heads // 4)
    tcfg = causal_lm_config(
        vocab, "qwen3", num_layers=max(point["taps"], 2), hidden=hidden, num_heads=heads, num_kv_heads=kv_heads,
        intermediate=point.get("intermediate", 3 * hidden), max_position_embeddings=max(4096, seq + bs),
    )
    window = point.get("sliding_window", 0)
    dflash2 = point["variant"] == "dflash2"
    cfg = drafter_config_from_target(
        tcfg, num_layers=point["layers"], block_size=bs, mask_token_id=vocab - 1,
        target_layer_ids=list(range(point["taps"])),
        layer_types=["sliding_attention"] * point["layers"] if window else None, sliding_window=window or None,
        dflash2=DFlash2Modules(point["conv_kernel_size"], point["conv_group_size"], point["selector_rank"],
                               point["selector_top_k"]) if dflash2 else None,
    )
    fast = point["variant"] != "reference"
    # Weights and features are drawn where they live: at the Qwen3-8B point that is ~2.3 G random
    # numbers per build, ~15 s on the host. Token ids and anchors come from a host generator.
    gen, host_gen = torch.Generator(device).manual_seed(0), torch.Generator().manual_seed(0)
    with device:
        drafter = DFlashDrafter(
            cfg, attention=point["attention"] if fast else "dense",
            activation_checkpointing=fast and point["checkpointing"], lean=fast,
        )
    drafter.reset_parameters(generator=gen)
    drafter.to(dtype=torch.float32 if point.get("autocast") else dtype)
    head = (torch.randn(vocab, hidden, generator=gen, device=device) * 0.02).to(dtype)
    embed = (torch.randn(vocab, hidden, generator=gen, device=device) * 0.02).to(dtype)
    # with soft labels the target's final normed states [B, S, H] follow the taps, as the trainer feeds them
    final = hidden if point.get("kd_weight", 0.0) > 0 else 0
    features = torch.randn(b, seq, point["taps"] * hidden + final, generator=gen, device=device).to(dtype)
    input_ids = torch.randint(0, vocab - 1, (b, seq), generator=host_gen).to(device)
    loss_mask = torch.ones(b, seq, dtype=torch.long, device=device)
    lengths = torch.full((b,), seq, device=device)
    n = min(n, seq - 1)
    anchors = torch.stack([torch.randperm(seq - 1, generator=host_gen)[:n].sort().values for _ in range(b)]).to(device)
    valid = torch.ones(b, n, dtype=torch.bool, device=device)
    dpace = 0.5 if point.get("weighting", "decay") == "dpace" else None
    labels, weights = block_labels_and_weights(input_ids, loss_mask, lengths, anchors, valid, bs,
                                               None if dpace else default_gamma(bs))
    block_ids = torch.full((b, n, bs), vocab - 1, device=device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    auf = 0.0 if point.get("auf") else None
    return drafter, Heads(embed, head), (features, Blocks(anchors, valid, block_ids, labels, weights,
                                                          SlotLoss(dpace_alpha=dpace, auf_factor=auf),
                                                          SelectorLoss(1.0) if dflash2 else None))


def step_fn(point: dict, drafter, heads, inputs):
    """The timed step: the trainer's own micro-step (``forward_backward``) on ``inputs``, with the
    strategy of the drafter's family and a one-process backend. The reference variant turns off
    every saving (``Strategy.drafter_forward``'s oracle switches)."""

    fast = point["variant"] != "reference"
    features, blocks = inputs
    autocast = torch.autocast(point["device"], dtype=getattr(torch, point["dtype"]),
                              enabled=bool(point.get("autocast")))
    options = {} if fast else {"scored_only": False, "distinct_rows": False}  # the reference: every slot, in full
    objective = ObjectiveConfig(loss_chunk_size=point["chunk"] if fast else 0,
                                anchors_per_microbatch=point["anchors_per_microbatch"] if fast else 0,
                                kd_weight=point.get("kd_weight", 0.0), kd_temperature=point.get("kd_temperature", 1.0))
    strategy, backend = strategy_for(drafter, heads, objective), Backend(drafter)

    def step():
        drafter.zero_grad(set_to_none=True)
        outs = forward_backward(strategy, backend, features, blocks, autocast=autocast, **options)
        return SimpleNamespace(loss=torch.stack([o.loss.detach() for o in outs]).sum())

    return step


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M).group(1)) * 1024


def _reset_rss_peak() -> bool:
    """Reset VmHWM (Linux >= 4.0); False where /proc/self/clear_refs cannot be written."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def saved_activations(drafter, heads):
    """A saved_tensors_hooks context counting the bytes autograd saves for backward (each storage
    once), weights and their casts apart (tensors of a weight's shape): ``with ... as saved``,
    then ``saved["bytes"]``. Counts what a step keeps, not its peak (no transients)."""
    weights = [*drafter.parameters(), *heads.parameters()]
    shapes, ptrs = {tuple(w.shape) for w in weights}, {w.untyped_storage().data_ptr() for w in weights}
    seen: dict[int, int] = {}
    result = {"bytes": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in ptrs and tuple(t.shape) not in shapes:
            seen[ptr] = t.untyped_storage().nbytes()
            result["bytes"] = sum(seen.values())
        return t

    class Context(torch.autograd.graph.saved_tensors_hooks):
        def __enter__(self):
            super().__enter__()
            return result

    return Context(pack, lambda t: t)


def measure(point: dict) -> dict:
    """Time (median of ``repeat`` steps) and peak extra memory of one point, after one warm-up step
    (whose saved-for-backward activations are counted: ``saved_mib``)."""
    if point["threads"]:
        torch.set_num_threads(point["threads"])
    cuda = point["device"] == "cuda"
    drafter, heads, inputs = build(point)
    step = step_fn(point, drafter, heads, inputs)
    with saved_activations(drafter, heads) as saved:
        step().loss.item()  # warm-up: lazy initialisation is not the step's memory
    drafter.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    elif _reset_rss_peak():
        base = _proc_status_bytes("VmRSS")
    else:  # no resettable high-water mark: the process's, warm-up included
        base = None
    times = []
    for _ in range(max(point["repeat"], 1)):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = step()
        if cuda:
            torch.cuda.synchronize()
        else:
            out.loss.item()  # sync point: the step is done
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    elif base is not None:
        peak = _proc_status_bytes("VmHWM") - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    times.sort()
    return {**point, "ms_per_step": 1e3 * times[len(times) // 2], "peak_mib": peak / 2**20,
            "saved_mib": saved["bytes"] / 2**20,
            "loss": float(out.loss), "threads": torch.get_num_threads()}


def time_interleaved(points: list[dict]) -> list[list[float] | str]:
    """ms per step of each point in each of ``repeat`` rounds, measured in THIS process with the
    variants alternating step by step (so load from other processes hits all of them alike). A
    variant that runs out of GPU memory here (all variants live at once, unlike in the memory
    subprocesses) keeps the rounds it finished, or gets the error text if none, and the others
    are still timed."""
    if points[0]["threads"]:
        torch.set_num_threads(points[0]["threads"])
    steps, rounds, errors = [], [[] for _ in points], [""] * len(points)

    def attempt(i: int, fn) -> bool:
        """Run fn(); on out-of-memory drop variant i (its tensors go with the traceback)."""
        try:
            fn()
            return True
        except torch.OutOfMemoryError as exc:
            steps[i] = None
            errors[i] = f"out of memory while timing with the other variants built: {str(exc).splitlines()[0]}"
        torch.cuda.empty_cache()  # outside the except block: the failed step's tensors are free now
        return False

    for i, point in enumerate(points):
        steps.append(None)

        def build_and_warm_up(i=i, point=point):
            steps[i] = step_fn(point, *build(point))
            steps[i]()

        attempt(i, build_and_warm_up)
    for _ in range(points[0]["repeat"]):
        for i, step in enumerate(steps):
            if step is None:
                continue
            cuda = points[i]["device"] == "cuda"
            if cuda:
                torch.cuda.synchronize()

            def timed_step(step=step, cuda=cuda):
                out = step()
                if cuda:
                    torch.cuda.synchronize()
                else:
                    out.loss.item()  # sync point: the step is done

            t0 = time.perf_counter()
            if attempt(i, timed_step):
                rounds[i].append(1e3 * (time.perf_counter() - t0))
    return [r if r else errors[i] for i, r in enumerate(rounds)]


def run_point(point: dict) -> dict:
    """``measure`` in a process of its own (a clean RSS / CUDA high-water mark; module doc); an
    out-of-memory or a crash there is reported, not raised. On CPU the process is a fork of this
    one, measuring on one thread (``memory_threads``): a forked child that enters the OpenMP
    pool of a parent which has run parallel ops hangs (libgomp is not fork-safe)."""
    if torch.device(point["device"]).type != "cpu":  # CUDA (any device but the CPU): no fork
        return _in_fresh_interpreter(point)
    from multiprocessing import Pipe

    receive, send = Pipe(duplex=False)
    threads = point["threads"] or torch.get_num_threads()
    pid = os.fork()
    if pid == 0:  # the child: measure, send, leave without running the parent's exit handlers
        try:
            receive.close()
            _as_a_measuring_fork()
            try:  # one thread: a fork cannot use the OpenMP threads of a parent that ran ops (it hangs)
                result = {**measure({**point, "threads": 1}), "threads": threads, "memory_threads": 1}
            except BaseException as exc:  # out of memory, a stop: the row says so
                result = {**point, "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
            send.send(result)
        finally:
            os._exit(0)
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # the child died before sending (the OOM killer, a crash)
        result = None
    except BaseException:  # a stop or Ctrl-C here: the child goes too
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    if result is None:
        return {**point, "error": f"rc {os.waitstatus_to_exitcode(status)}: the measuring process died"}
    return result


def _as_a_measuring_fork() -> None:
    """Through glibc: SIGKILL this fork when its parent dies (prctl PR_SET_PDEATHSIG: a killed
    benchmark leaves no measurement running), and fix the mmap threshold at 64 KiB
    (MALLOC_MMAP_THRESHOLD_=65536 for a fresh interpreter: freed tensors go back to the OS, so
    RSS follows the live ones). Elsewhere neither: the allocator's own behaviour."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _in_fresh_interpreter(point: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "flashdraft.bench.step", "--worker", json.dumps(point)],
        capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {**point, "error": f"rc {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _point(args, seq, anchors, hidden, variant) -> dict:
    precision = resolve_precision(args)
    kd_weight = args.kd_weight or 0.5 if variant == "kd" else args.kd_weight
    dtype, autocast = PRECISIONS[precision]
    return dict(
        seq=seq, anchors=anchors, hidden=hidden, layers=args.layers, block=args.block, vocab=args.vocab,
        batch=args.batch, taps=args.taps, chunk=args.chunk, anchors_per_microbatch=args.anchors_per_microbatch,
        checkpointing=args.checkpointing, attention=args.attention, variant=variant, repeat=args.repeat,
        threads=args.threads, device=args.device, precision=precision, dtype=dtype, autocast=autocast,
        head_dim=args.head_dim,
        intermediate=args.intermediate or 3 * hidden, sliding_window=args.sliding_window, weighting=args.weighting,
        kd_weight=kd_weight, kd_temperature=args.kd_temperature, auf=args.auf,
        conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
    )


def useful_flops(p: dict) -> float:
    """FLOPs the step NEEDS, forward + backward: matmuls only, 2 per multiply-add.

    Rows: a block's slot 0 (the anchor) is never scored, so the last layer needs its queries,
    output projection and MLP, and the head, on the N * (bs - 1) scored rows only; layer 0's
    q / k / v only on the N + 1 distinct input rows (anchors + MASK). Keys: context j < anchor
    (S / 2 on average) and the block's own bs slots. Backward: 2x forward where the weight
    trains and the input needs a gradient; 1x where only one does: the fusion fc and layer 0's
    q / k / v (inputs: the target's features and embeddings) and the frozen LM head.
    """
    h, s, n, bs, v, b = p["hidden"], p["seq"], p["anchors"], p["block"], p["vocab"], p["batch"]
    heads = max(1, h // p["head_dim"])
    hkv, d = max(1, heads // 4), h // heads
    q_dim, kv_dim = heads * d, hkv * d
    rows, scored = n * bs, n * (bs - 1)
    flops = 2 * 2 * s * p["taps"] * h * h  # fusion fc
    flops += 2 * 2 * scored * h * v  # LM head
    for i in range(p["layers"]):
        out = scored if i == p["layers"] - 1 else rows  # rows whose output is used
        if i == 0:
            flops += 2 * 2 * (n + 1) * h * (q_dim + 2 * kv_dim)
        else:
            flops += 3 * 2 * h * (out * q_dim + rows * 2 * kv_dim)
        flops += 3 * 2 * 2 * out * heads * d * (s / 2 + bs)  # scores and values over the needed keys
        flops += 3 * 2 * out * (q_dim * h + 3 * h * p["intermediate"])  # o_proj + SwiGLU MLP
        flops += 3 * 2 * s * h * 2 * kv_dim  # context K / V
    return b * flops


def _fmt(r: dict) -> str:
    if "error" in r:
        peak = f"{r['peak_mib']:.1f}" if "peak_mib" in r else "nan"
        return f"{r['variant']} ms_per_step=nan peak_mib={peak} ({r['error']})"
    saved = f" saved_mib={r['saved_mib']:.1f}" if "saved_mib" in r else ""
    return f"{r['variant']} ms_per_step={r['ms_per_step']:.1f} peak_mib={r['peak_mib']:.1f}{saved}"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def _slope(xs, ys) -> float:
    """Least-squares slope of log(y) on log(x): time ~ x ** slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _spread(base: dict, other: dict) -> str:
    """The per-round ratios of ``other`` to ``base``: their median and range (timings interleaved)."""
    per_round = sorted(o / b for b, o in zip(base.get("ms_rounds", []), other.get("ms_rounds", [])))
    if len(per_round) < 2:
        return ""
    return (f" (per round: median {per_round[len(per_round) // 2]:.2f}x, range {per_round[0]:.2f}-"
            f"{per_round[-1]:.2f}x over {len(per_round)} rounds)")


def _print_ratios(args, row: dict) -> None:
    """The fast step's achieved FLOP rate, and each other variant's time and memory against it."""
    f = row.get("fast")
    if not f or "error" in f:
        return
    tflops = useful_flops(f) / (f["ms_per_step"] * 1e-3) / 1e12
    share = f" = {100 * tflops / args.peak_tflops:.1f}% of peak" if args.peak_tflops else ""
    print(f"  fast achieved {tflops:.3f} TFLOP/s of needed work{share}", flush=True)

    def ratios(other: dict) -> tuple[float, float]:
        return other["ms_per_step"] / f["ms_per_step"], other["peak_mib"] / max(f["peak_mib"], 1e-9)

    v2, kd, ref = row.get("dflash2"), row.get("kd"), row.get("reference")
    if v2 and "error" not in v2:
        print("  dflash2 / fast: time {:.2f}x memory {:.2f}x (conv + selector at these shapes)".format(*ratios(v2)),
              flush=True)
    if kd and "error" not in kd:
        time_x, memory_x = ratios(kd)
        print(f"  kd / fast: time {time_x:.2f}x memory {memory_x:.2f}x (soft labels, kd_weight {kd['kd_weight']})"
              f"{_spread(f, kd)}", flush=True)
    if ref and "error" not in ref:
        time_x, memory_x = ratios(ref)
        print(f"  speedup={time_x:.2f}x memory_ratio={memory_x:.2f}x{_spread(f, ref)}", flush=True)


def run(args) -> int:
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - {"fast", "reference", "dflash2", "kd"})
    if unknown or not variants:
        raise ValueError(f"--variants {args.variants!r}: use a comma list of fast, reference, dflash2, kd")
    single = any(x is not None for x in (args.seq, args.anchors, args.hidden))
    if single:
        grid = {"point": [(args.seq or 1024, args.anchors or 128, args.hidden or 256)]}
    else:
        grid = {name: DEFAULT_GRID[name] for name in args.sweeps.split(",") if name}
    print(f"drafter step (forward + backward): layers={args.layers} block={args.block} vocab={args.vocab} "
          f"batch={args.batch} device={args.device} precision={resolve_precision(args)} "
          f"threads={args.threads or torch.get_num_threads()} "
          f"chunk={args.chunk} anchors_per_microbatch={args.anchors_per_microbatch} checkpointing={args.checkpointing} "
          f"weighting={args.weighting} kd_weight={args.kd_weight} kd_temperature={args.kd_temperature} auf={args.auf}")
    # peak memory first, each (point, variant) in a process of its own (run_point: on CPU a fork
    # of this process, forked before its timing has grown it)
    seen = {}
    for points in grid.values():
        for seq, anchors, hidden in points:
            for variant in variants:
                if (seq, anchors, hidden, variant) not in seen:
                    seen[seq, anchors, hidden, variant] = run_point(
                        {**_point(args, seq, anchors, hidden, variant), "repeat": 0})
    results = []
    for sweep, points in grid.items():
        if not single:
            print(f"\n[{sweep} sweep]")
        for seq, anchors, hidden in points:
            print(f"seq={seq} anchors={anchors} hidden={hidden} (load average {_loadavg()})", flush=True)
            row = {variant: seen[seq, anchors, hidden, variant] for variant in variants}
            timed = [v for v in variants if "error" not in row[v] and "ms_min" not in row[v]]
            if timed:  # time: in-process, variants alternating (shared hosts are noisy)
                for v, ms in zip(timed, time_interleaved([_point(args, seq, anchors, hidden, v) for v in timed])):
                    if isinstance(ms, str):
                        row[v]["error"] = ms
                    else:  # the min over rounds: robust to other processes on a shared host
                        row[v]["ms_per_step"] = row[v]["ms_min"] = min(ms)
                        row[v]["ms_rounds"] = ms
            for variant in variants:
                results.append(row[variant])
                print("  " + _fmt(row[variant]), flush=True)
            _print_ratios(args, row)
        if sweep in ("seq", "anchors"):
            field = "seq" if sweep == "seq" else "anchors"
            for variant in variants:
                ok = [seen[(s, a, h, variant)] for s, a, h in points if "error" not in seen[(s, a, h, variant)]]
                if len(ok) >= 2:
                    xs, ys = [r[field] for r in ok], [r["ms_per_step"] for r in ok]
                    print(f"  cost growth {variant}: time ~ {field}^{_slope(xs, ys):.2f} "
                          f"({ys[-1] / ys[0]:.2f}x time for {xs[-1] / xs[0]:.1f}x {field})")
    if args.json:
        from flashdraft.outputs import write_report

        write_report(args.json, json.dumps(results, indent=1), flag="--json")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
