"""The memory plan: whether a run fits its device, known before any weights load.

``plan_memory(cfg)`` reads the target's ``config.json`` (nothing else from its directory) and
the run config, and estimates the per-device peak memory of training at the real sizes:

- the target's weights come from the Hugging Face model class built on the meta device (its
  own parameter shapes, no bytes), in the compute dtype, sharded over ``target.tensor_parallel``;
- the drafter's training state and step are MEASURED: the real drafter (drafter/model.py) is
  built and one real optimizer step (train/step.py ``forward_backward``, the objective, the
  trainer's AdamW) runs under ``FakeTensorMode`` on the planned device at the worst
  micro-batch's real shapes, with torch's ``MemTracker`` counting the live bytes. Fake tensors
  carry shapes and dtypes but no data, so this costs Python time only, and the figure follows
  the code (autocast, the lean kernels, the chunked head, DFlash2's modules, checkpointing);
- the attention kernels are the one part modelled rather than run (their masks depend on the
  anchors' values, which fake tensors do not have): a stand-in saves for backward what the
  real kernel saves (flex: q, k, v, the output and the fp32 log-sum-exp; blockwise: q, k, v,
  the output, the last layer's probabilities and the plan's additive masks);
- the target's no-grad forward and the features in flight are formulas of the target's
  config (a Mixture-of-Experts forward routes by value, which fake tensors cannot run).

Every role of the job is counted, and the plan's peak is the largest: a colocated rank; or, in
a disaggregated job, a drafter rank (the target's embedding and LM head), drafter rank 0 when
the run evaluates (the whole target: it decodes the evals) and a target rank (its features for
each drafter rank it feeds: the job's world size is an input).

The worst micro-batch follows the batch plan: a padded length S holds
B = min(max_batch_size, token_budget // S, row_budget // (min(num_anchors, S - 1) * block_size))
samples (at least 1), each with max(1, min(num_anchors, S - 1)) anchored blocks, sliced by
``objective.anchors_per_microbatch`` and shared over a tensor-parallel group. The worst S up to
``data.max_length`` is found with a linear model of the step's measured peak in
(B, S, anchors), fitted from four small fake steps, and then measured at its real shapes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import types
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashdraft.config import Config
from flashdraft.data.batching import anchor_slots, batch_capacity, check_row_budget
from flashdraft.train.checks import check_drafter_sizes, drafter_rows

log = logging.getLogger(__name__)

GiB = 2**30


@dataclass
class MemoryPlan:
    """The estimated per-device peak of one training run and what it is made of."""

    peak_bytes: int  # the largest consumer sum over the run's roles (a device's peak)
    consumers: list[tuple[str, int]]  # (what, bytes) on the device at that peak, largest first
    device_bytes: int | None  # the device's memory (None: unknown, e.g. CPU training)
    fits: bool  # peak_bytes within device_bytes minus the margin (True when device_bytes is None)
    advice: list[str]  # what to change when it does not fit (or is close)
    seq_len: int = 0  # the padded length S of the micro-batch the peak is at
    batch_size: int = 0  # samples in that micro-batch
    rows: int = 0  # drafter rows (anchors x block_size) of one forward + backward (a slice) on this device
    # whose peak this is: a colocated, drafter (rank 0 evaluating or not) or target rank
    role: str = "colocated rank"
    device: str = "cuda"
    notes: list[str] = field(default_factory=list)
    # every role's consumers, largest first
    roles: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    MARGIN = 0.05  # of the device kept free: CUDA context, allocator fragmentation, NCCL buffers

    def format(self) -> str:
        """The plan as a readable table, its verdict and its advice."""
        width = max([len(name) for name, _ in self.consumers] + [len("total (peak)")])
        lines = [f"memory plan ({self.role}, {self.device}): worst micro-batch S={self.seq_len}, "
                 f"B={self.batch_size}, {self.rows} drafter rows per forward + backward",
                 f"  {'consumer':<{width}}  {'GiB':>8}"]
        lines += [f"  {name:<{width}}  {size / GiB:8.2f}" for name, size in self.consumers]
        lines.append(f"  {'total (peak)':<{width}}  {self.peak_bytes / GiB:8.2f}")
        lines.append(self.verdict())
        lines += [f"  - {a}" for a in self.advice]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def verdict(self) -> str:
        if self.device_bytes is None:
            return f"peak {self.peak_bytes / GiB:.2f} GiB (no device memory limit given)"
        usable = self.device_bytes * (1 - self.MARGIN)
        word = "fits" if self.fits else "does NOT fit"
        return (f"{word}: peak {self.peak_bytes / GiB:.2f} GiB of {self.device_bytes / GiB:.1f} GiB "
                f"({usable / GiB:.1f} GiB usable, {self.MARGIN:.0%} kept free)")


# ---- the target, from its config.json ------------------------------------------------------


@dataclass(frozen=True)
class TargetShape:
    """What the plan needs of the target: its sizes and its weight bytes (from config.json)."""

    hidden: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's (0 for a pure MoE)
    experts: int  # routed experts (0: dense)
    experts_per_token: int
    expert_intermediate: int
    params: int  # every parameter
    head_params: int  # the input embedding and the LM head (one table when tied)
    config: object  # the transformers config (text part)
    model_config: object  # the whole transformers config (the class it maps to, its tensor-parallel plan)
    max_positions: int  # max_position_embeddings (0: none given)


def target_config_path(target: str, trust_remote_code: bool = False) -> Path:
    """target.path's config.json, read and checked as train reads it (target.model._model_dir:
    one line naming the file and field for a config nothing can be built from)."""
    from flashdraft.target.model import _model_dir

    return _model_dir(target, trust_remote_code) / "config.json"


@functools.lru_cache(maxsize=8)
def _target_shape(path: str, trust_remote_code: bool) -> TargetShape:
    from transformers import AutoConfig, AutoModelForCausalLM

    from flashdraft.target.model import _decoder_layers

    config = AutoConfig.from_pretrained(str(Path(path).parent), trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # the class's own parameter shapes, no bytes (sizes bounded: read_model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    _decoder_layers(model)  # a model train cannot tap (no decoder layers) is refused here as there
    heads = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
             for p in m.parameters()}
    params = sum(p.numel() for p in model.parameters())
    head_params = sum(p.numel() for p in model.parameters() if id(p) in heads)
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
    hidden, n_heads = int(text.hidden_size), int(text.num_attention_heads)
    return TargetShape(
        hidden=hidden, vocab=int(text.vocab_size), layers=int(text.num_hidden_layers), heads=n_heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or n_heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // n_heads),
        intermediate=0 if experts else int(getattr(text, "intermediate_size", 0) or 0), experts=experts,
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0),
        expert_intermediate=int(getattr(text, "moe_intermediate_size", 0)
                                or getattr(text, "intermediate_size", 0)),
        params=params, head_params=head_params, config=text, model_config=config,
        max_positions=int(getattr(text, "max_position_embeddings", 0) or 0))


# ---- the worst micro-batch -----------------------------------------------------------------


def longest(cfg: Config) -> int:
    """The longest padded length a micro-batch can have: data.max_length, or the token budget
    when that is smaller (the start-up checks refuse longer samples)."""
    return min(cfg.data.max_length, cfg.data.token_budget)


def batch_size_at(cfg: Config, seq_len: int) -> int:
    """Samples of padded length ``seq_len`` one micro-batch holds under the batch plan's budgets
    (the batch plan's own rule)."""
    return max(1, batch_capacity(seq_len, cfg.data.token_budget, cfg.data.max_batch_size, drafter_rows(cfg)))


def anchors_per_pass(cfg: Config, seq_len: int) -> int:
    """Anchored blocks per sample in one forward + backward on one rank: the anchor tensor's
    width ``anchor_slots(S, num_anchors)`` (what the batch plan counts), shared over a colocated
    tensor-parallel group (Blocks.shard; a disaggregated drafter rank trains them all), then
    sliced by objective.anchors_per_microbatch."""
    n = int(anchor_slots(seq_len, cfg.objective.num_anchors))
    if cfg.pipeline.placement == "colocated":
        n = -(-n // cfg.target.tensor_parallel)
    apm = cfg.objective.anchors_per_microbatch
    return min(n, apm) if apm > 0 else n


# ---- the drafter's step, measured on fake tensors ------------------------------------------


class _HeadsStub:
    """The target's embedding and LM head as the step reads them (train/strategy.py ``forward_loss``);
    plain tensors, not modules, so the tracker counts their outputs but not their weights (the
    target's, counted with it)."""

    def __init__(self, vocab: int, hidden: int, dtype, device):
        self.lm_head = types.SimpleNamespace(weight=torch.empty(vocab, hidden, dtype=dtype, device=device))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.lm_head.weight)


class LiveBytes(TorchDispatchMode):
    """The live bytes of the tensors created while it is active, and their peak: each op's new
    storages are counted once and uncounted when freed (a weakref finalizer). Works on fake
    tensors. (torch's MemTracker answers the same, but rescans every live tensor at every op:
    ~10 s per fake step of the 8B drafter here, against ~1 s.)"""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._ids: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self._ids.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.prim.device.default:  # thousands of .device queries: no tensor made
            return out
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._ids:
                    size = storage.nbytes()
                    self._ids.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, size)
        return out


@dataclass(frozen=True)
class StepMeasure:
    peak: int  # the step's peak live bytes (drafter weights, grads, AdamW state, everything it allocates)
    weights: int
    grads: int
    optimizer: int
    autocast_cache: int  # the bf16 copies of the drafter's weights autocast keeps through the backward


def feature_states(cfg: Config, taps: int) -> int:
    """Hidden states per token in a step's features: the taps, and with soft labels
    (objective.kd_weight > 0) the target's final normed state after them (TargetModel)."""
    return taps + (cfg.objective.kd_weight > 0)


def _drafter_config(cfg: Config, shape: TargetShape) -> dict:
    """The run's drafter config, as the trainer builds it (serving.drafter_config_of), from the
    target's config.json alone."""
    from flashdraft.drafter.serving import drafter_config_of
    from flashdraft.target import default_target_layer_ids

    ids = (list(cfg.target.layer_ids) if cfg.target.layer_ids is not None
           else default_target_layer_ids(shape.layers, cfg.target.num_taps))
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else shape.vocab - 1
    return drafter_config_of(cfg.drafter, shape.config, ids, mask_id)


def measure_step(cfg: Config, shape: TargetShape, device: str, batch: int, seq_len: int,
                 anchors: int) -> StepMeasure:
    """One optimizer step of the real drafter at micro-batch [batch, seq_len] with ``anchors``
    blocks per sample (one slice), under FakeTensorMode on ``device``; its peak live bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashdraft.drafter import DFlashDrafter
    from flashdraft.drafter.attention import resolve_attention
    from flashdraft.drafter.stand_in import stand_in_name
    from flashdraft.objective import Blocks, SelectorLoss, SlotLoss
    from flashdraft.target import resolve_dtype
    from flashdraft.train.backend import Backend
    from flashdraft.train.optim import build_optimizer
    from flashdraft.train.step import forward_backward
    from flashdraft.train.strategy import freeze_untrained, strategy_for

    dev = torch.device(device)
    dtype = resolve_dtype(cfg.target.dtype, dev)
    impl = resolve_attention(cfg.drafter.attention, dev, True)
    if cfg.drafter.attention_sink and impl == "flex":
        impl = "blockwise"
    config = _drafter_config(cfg, shape)
    bs, k = cfg.drafter.block_size, feature_states(cfg, len(config["dflash_config"]["target_layer_ids"]))
    # Fake tensors live on the CPU (a CPU-only torch cannot make CUDA ones): a CUDA run's bf16
    # autocast is CPU autocast here, the same casts of the drafter's matmuls.
    host = torch.device("cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=False):
        drafter = DFlashDrafter(config, attention=stand_in_name(impl),
                                activation_checkpointing=cfg.drafter.activation_checkpointing)
        freeze_untrained(drafter, cfg.objective)
        heads = _HeadsStub(shape.vocab, shape.hidden, dtype, host)
        optimizer, _ = build_optimizer(drafter.parameters(), cfg.optim, 10, dev)
        trainable = [p for p in drafter.parameters() if p.requires_grad]
        weights = sum(p.numel() * p.element_size() for p in drafter.parameters())
        grads = sum(p.numel() * 4 for p in trainable)
        autocast_cache = sum(m.weight.numel() * 2 for m in drafter.modules()
                             if isinstance(m, torch.nn.Linear)) if dev.type == "cuda" else 0
        tracker = LiveBytes()
        with tracker:
            for p in trainable:  # the optimizer's state exists from the first step on: make it now
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                        if torch.is_tensor(t))
            features = torch.empty(batch, seq_len, k * shape.hidden, dtype=dtype, device=host)
            ids = torch.zeros(batch, anchors, bs, dtype=torch.long, device=host)
            selector = (SelectorLoss(cfg.objective.selector_alpha) if drafter.candidate_selector is not None
                        else None)
            blocks = Blocks(torch.zeros(batch, anchors, dtype=torch.long, device=host),
                            torch.ones(batch, anchors, dtype=torch.bool, device=host), ids, ids,
                            torch.ones(batch, anchors, bs, device=host), SlotLoss.of(cfg.objective), selector)
            # one pass of ``anchors`` blocks (anchors_per_pass has applied objective.anchors_per_microbatch)
            strategy = strategy_for(drafter, heads, replace(cfg.objective, anchors_per_microbatch=0))
            forward_backward(strategy, Backend(drafter), features, blocks, autocast=autocast)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        total = weights + tracker.peak  # the weights exist before; everything else is counted
        # the features were counted (allocated inside): they are "features in flight", not the step's
        total -= batch * seq_len * k * shape.hidden * dtype.itemsize
    return StepMeasure(total, weights, grads, state, autocast_cache)


@dataclass(frozen=True)
class _StepModel:
    """The step's peak as c0 + B * (a * R + b * S + g * R * S), R = anchors per sample: fitted from
    four measured steps, used only to find the worst S (which is then measured)."""

    c0: float
    a: float
    b: float
    g: float

    def __call__(self, batch: int, seq_len: int, anchors: int) -> float:
        return self.c0 + batch * (self.a * anchors + self.b * seq_len + self.g * anchors * seq_len)


def _fit_step_model(cfg: Config, shape: TargetShape, device: str) -> _StepModel:
    bs, chunk = cfg.drafter.block_size, cfg.objective.loss_chunk_size
    n0 = max(32, math.ceil(1.05 * chunk / (bs - 1))) if chunk else 32  # rows past one head chunk: linear
    s0 = 2 * n0
    m = functools.partial(measure_step, cfg, shape, device)
    m1, m2 = m(1, s0, n0).peak, m(2, s0, n0).peak
    m3, m4 = m(1, s0, 2 * n0).peak, m(1, 2 * s0, n0).peak
    u, v, w = m2 - m1, m3 - m1, m4 - m1
    return _StepModel(c0=m1 - u, a=(u - w) / n0, b=(u - v) / s0, g=(v + w - u) / (n0 * s0))


def _worst_seq_len(cfg: Config, model: _StepModel, other, longest_s: int) -> int:
    """The padded length S in [2, ``longest_s``] whose micro-batch has the largest modelled peak
    (``other(B, S)``: the S-dependent bytes besides the step, e.g. the features in flight).

    Searched in steps, not length by length (a length of 10^9 took hours): the batch size B and
    the anchors per sample are monotone step functions of S, found as runs by bisection. Where
    both are constant the modelled peak is a convex quadratic in S (the padding mask's B * S^2),
    so its maximum is at an end of the run; where the anchors grow with S (S - 1 below
    objective.num_anchors) it is a quadratic too, whose vertex is tried besides the ends."""
    def peak(s: int) -> float:
        b = batch_size_at(cfg, s)
        return model(b, s, anchors_per_pass(cfg, s)) + other(b, s)

    growing_until = _first_at_least(lambda s: anchors_per_pass(cfg, s), anchors_per_pass(cfg, longest_s), 2,
                                    longest_s) - 1  # the anchors grow up to here, constant after
    candidates = {2, longest_s}
    for lo, hi in _runs(lambda s: batch_size_at(cfg, s), 2, longest_s):
        for a, b in ((lo, min(hi, growing_until)), (max(lo, growing_until + 1), hi)):
            if a > b:
                continue
            candidates |= {a, b}
            if b <= growing_until and b - a >= 2:  # the quadratic through both ends and the middle
                m = (a + b) // 2
                ya, ym, yb = peak(a), peak(m), peak(b)
                d1, d2 = (ym - ya) / (m - a), (yb - ym) / (b - m)
                curve = (d2 - d1) / (b - a)
                if curve < 0:  # concave: its maximum may lie inside, at the vertex
                    vertex = -(d1 - curve * (a + m)) / (2 * curve)
                    candidates |= {min(b, max(a, v)) for v in (math.floor(vertex), math.ceil(vertex))}
    return max(sorted(candidates), key=peak)  # ties: the shortest, as a scan from S = 2 finds


def _runs(fn, lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal runs [a, b] of lo..hi over which the monotone step function ``fn`` is constant,
    each end found by bisection."""
    runs = []
    while lo <= hi:
        value, a, b = fn(lo), lo, hi
        while a < b:  # the last s in lo..hi with fn(s) == value
            m = (a + b + 1) // 2
            if fn(m) == value:
                a = m
            else:
                b = m - 1
        runs.append((lo, a))
        lo = a + 1
    return runs


def _first_at_least(fn, value, lo: int, hi: int) -> int:
    """The first s in lo..hi with ``fn(s) >= value`` for a non-decreasing ``fn`` (hi when none
    is earlier)."""
    while lo < hi:
        m = (lo + hi) // 2
        if fn(m) >= value:
            hi = m
        else:
            lo = m + 1
    return lo


# ---- the target's side: formulas of its config ----------------------------------------------


def target_forward_bytes(shape: TargetShape, cfg: Config, batch: int, seq_len: int, dtype_bytes: int,
                         features: int) -> int:
    """The no-grad forward's transient peak up to the last tapped layer: the taps held until
    they are packed, one layer's working set (residual, normed input, q / k / v, attention
    output, the MLP's gate / up / product, or a MoE layer's router logits and routed copies),
    and a padded batch's [B, 1, S, S] boolean mask (``features``: the states kept per token,
    ``feature_states``). Column-sharded terms divide by the group."""
    tokens, tp = batch * seq_len, cfg.target.tensor_parallel
    taps = features * tokens * shape.hidden
    attn = tokens * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * 2 // tp
    if shape.experts:
        mlp = tokens * shape.experts_per_token * (shape.hidden + 3 * shape.expert_intermediate // tp)
        mlp += tokens * shape.experts * 4 // dtype_bytes  # fp32 router logits
    else:
        mlp = 3 * tokens * shape.intermediate // tp
    working = 3 * tokens * shape.hidden + max(attn, mlp)
    return (taps + working) * dtype_bytes + batch * seq_len * seq_len


def target_weight_bytes(shape: TargetShape, cfg: Config, dtype_bytes: int, heads_only: bool) -> int:
    """This rank's share of the target's weights: all of them over the group (tensor / expert
    parallel), plus the whole embedding and LM head the drafter uses (gathered once when
    sharded); a drafter rank of a disaggregated job holds only those two."""
    if heads_only:
        return shape.head_params * dtype_bytes
    tp = cfg.target.tensor_parallel
    whole_heads = shape.head_params if tp > 1 else 0
    return (shape.params // tp + whole_heads) * dtype_bytes


# ---- the plan --------------------------------------------------------------------------------


def _planned_device(cfg: Config, device: str | None) -> str:
    if device is not None:
        return torch.device(device).type
    return "cpu" if cfg.train.device == "cpu" else "cuda"


@dataclass(frozen=True)
class _Sizes:
    """The run's byte counts that are formulas of the target's config (see the module doc)."""

    cfg: Config
    shape: TargetShape
    dtype_bytes: int
    taps: int  # feature states per token (feature_states)
    links: int = 1  # a disaggregated target rank's drafter links (the drafter ranks it feeds)
    # a vLLM engine on this device (target.vllm_devices empty): its gpu_memory_utilization
    engine_share: int = 0

    @property
    def engine(self) -> bool:
        """Whether a vLLM engine computes the features (target.backend=vllm): a rank that
        would run the target forward holds its embedding and LM head only, and no forward."""
        return self.cfg.target.backend == "vllm"

    def steps_held(self, role: str) -> int:
        """Steps whose features exist at once on a ``role`` rank, besides the micro-batch a target
        forward is computing (its taps, counted with the forward). Colocated: the channel between
        the target stage and the step (pipeline.capacity, when pipelined) and the step's own. A
        drafter rank: the step it trains (it receives the next one after). A target rank: for
        each link, the steps sent but not yet received (pipeline.capacity); one more, waiting for
        a link's oldest to be received; and the channel before the sends (pipeline.capacity, when
        its stages run on threads: an unsharded target)."""
        p = self.cfg.pipeline
        if role == "target":
            threaded = p.enabled and self.cfg.target.tensor_parallel == 1
            return p.capacity * self.links + 1 + (p.capacity if threaded else 0)
        if role == "drafter":
            return 1
        return (p.capacity if p.enabled else 0) + 1

    def features(self, b: int, s: int, role: str) -> int:
        steps = self.cfg.train.grad_accum * self.steps_held(role)
        return steps * b * s * self.taps * self.shape.hidden * self.dtype_bytes

    def target_forward(self, b: int, s: int) -> int:
        if self.engine:  # the engine's prefill runs in its own process, on target.vllm_devices
            return 0
        return target_forward_bytes(self.shape, self.cfg, b, s, self.dtype_bytes, self.taps)

    def target_weights(self) -> tuple[str, int]:
        """What the rank that computes features holds of the target's weights, named."""
        cfg, tp = self.cfg, self.cfg.target.tensor_parallel
        if self.engine:
            return ("target embedding + LM head (the vLLM engine holds the rest)",
                    target_weight_bytes(self.shape, cfg, self.dtype_bytes, heads_only=True))
        return (f"target weights{f' (1/{tp}, + whole embedding / LM head)' if tp > 1 else ''}",
                target_weight_bytes(self.shape, cfg, self.dtype_bytes, heads_only=False))

    def overlap(self, b: int, s: int) -> int:
        """What the step shares the device with besides its own: the features in flight and, when
        a colocated pipeline overlaps them, the next micro-batch's target forward."""
        cfg = self.cfg
        if cfg.pipeline.placement == "disaggregated":
            return self.features(b, s, "drafter")
        return self.features(b, s, "colocated") + (self.target_forward(b, s) if cfg.pipeline.enabled else 0)


def drafter_links(cfg: Config, world_size: int | None) -> int:
    """The drafter ranks each disaggregated target rank (or target group) feeds on a job of
    ``world_size`` ranks; 1 when colocated. ValueError naming the fix when the layout is wrong or
    a disaggregated job's world size is not given."""
    if cfg.pipeline.placement == "colocated":
        return 1
    if world_size is None:
        raise ValueError("pipeline.placement=disaggregated: give the job's world size (`flashdraft plan "
                         "--world-size N`, torchrun's nnodes x nproc-per-node): a target rank holds the "
                         "features of every drafter rank it feeds")
    from flashdraft.distributed import role_layout

    drafters, targets = role_layout(world_size, cfg.pipeline.target_ranks, cfg.target.tensor_parallel)
    return len(drafters) // (len(targets) // cfg.target.tensor_parallel)


def evaluates(cfg: Config) -> bool:
    """Whether the run evaluates during training (eval.data_path or eval.prompts_path): its main
    rank then decodes with the whole target (a disaggregated drafter rank 0 loads all of it)."""
    return bool(cfg.eval.data_path or cfg.eval.prompts_path)


def plan_memory(cfg: Config, *, device_bytes: int | None = None, seq_len: int | None = None,
                device: str | None = None, world_size: int | None = None) -> MemoryPlan:
    """The per-device peak memory of training ``cfg`` (see the module doc), at the worst padded
    length up to data.max_length or at ``seq_len``; ``device_bytes`` the device's memory (None:
    no limit known); ``device`` "cuda" or "cpu" (default: from train.device, cuda unless cpu);
    ``world_size`` the job's ranks (needed by a disaggregated plan: the drafter links a target
    rank feeds). The peak is the largest over the run's roles: a colocated rank; or a
    disaggregated job's drafter rank, its drafter rank 0 when it evaluates (the whole target),
    and its target rank. Reads only target.path's config.json; loads no weights."""
    from flashdraft.target import default_target_layer_ids, resolve_dtype

    dev = _planned_device(cfg, device)
    links = drafter_links(cfg, world_size)
    path = target_config_path(cfg.target.path, cfg.target.trust_remote_code)
    shape = _target_shape(str(path), cfg.target.trust_remote_code)
    ids = (list(cfg.target.layer_ids) if cfg.target.layer_ids is not None
           else default_target_layer_ids(shape.layers, cfg.target.num_taps))
    _refuse_as_train_would(cfg, shape, path.parent, ids, dev)
    top, why = planned_lengths(cfg, shape)
    if top < 2:
        raise ValueError(f"no sample of 2 or more tokens can be trained ({why}); "
                         "fix the target's config.json")
    dtype_bytes = resolve_dtype(cfg.target.dtype, torch.device(dev)).itemsize
    sizes = _Sizes(cfg, shape, dtype_bytes, feature_states(cfg, len(ids)), links,
                   _engine_share(cfg, dev, device_bytes))
    if seq_len is None:
        s = _worst_seq_len(cfg, _fit_step_model(cfg, shape, dev), sizes.overlap, top)
    elif not 2 <= seq_len <= top:
        raise ValueError(f"--seq-len {seq_len}: give a padded length in [2, {top}] ({why})")
    else:
        s = seq_len
    b, n = batch_size_at(cfg, s), anchors_per_pass(cfg, s)
    roles = {name: sorted(((what, int(v)) for what, v in parts if v > 0), key=lambda c: -c[1])
             for name, parts in _roles(sizes, measure_step(cfg, shape, dev, b, s, n), b, s,
                                       b * n * cfg.drafter.block_size).items()}
    totals = {name: sum(v for _, v in parts) for name, parts in roles.items()}
    role = max(totals, key=totals.get)
    others = [f"{name}: peak {total / GiB:.2f} GiB" for name, total in totals.items() if name != role]
    peak = totals[role]
    fits = device_bytes is None or peak <= device_bytes * (1 - MemoryPlan.MARGIN)
    capped = [] if top == longest(cfg) else [f"lengths planned up to {top}: {why}"]
    plan = MemoryPlan(peak, roles[role], device_bytes, fits, [], s, b, b * n * cfg.drafter.block_size, role,
                      dev, others + capped + _notes(cfg, dev), roles)
    if device_bytes is not None:
        plan.advice = _advice(cfg, plan, dict(roles[role]))
    return plan


def _engine_share(cfg: Config, dev: str, device_bytes: int | None) -> int:
    """The device memory a vLLM engine takes beside the rank: none unless it computes the
    features on the rank's own GPU (target.vllm_devices empty), then its gpu_memory_utilization
    of the device (vLLM allocates that share at start-up, whatever the model needs)."""
    if cfg.target.backend != "vllm" or cfg.target.vllm_devices or dev != "cuda" or not device_bytes:
        return 0
    return int(cfg.target.vllm_gpu_memory_utilization * device_bytes)


def _refuse_as_train_would(cfg: Config, shape: TargetShape, target_dir: Path, ids: list[int],
                           device: str) -> None:
    """Train's start-up checks that need only the target's config.json, in train's own words:
    the taps, a tensor-parallel group that cannot shard the target, DFlash2's sizes, and a row
    budget too small for any sample (a plan of a run train refuses would mislead)."""
    from flashdraft.target.model import check_layer_ids, check_tensor_parallel

    check_layer_ids(ids, shape.layers)
    if cfg.target.tensor_parallel > 1:
        check_tensor_parallel(target_dir, shape.model_config, cfg.target.tensor_parallel,
                              cfg.target.expert_parallel)
    check_drafter_sizes(cfg, device)
    check_row_budget(2, drafter_rows(cfg), "every sample (the shortest, 2 tokens, included)")


def planned_lengths(cfg: Config, shape: TargetShape) -> tuple[int, str]:
    """The longest padded length the run can see, and what bounds it: data.max_length or the
    token budget (``longest``), the target's max_position_embeddings and the row budget, beyond
    which train refuses samples (checks.check_lengths)."""
    bounds = [(longest(cfg),
               f"data.max_length={cfg.data.max_length}, data.token_budget={cfg.data.token_budget}")]
    if shape.max_positions:
        bounds.append((shape.max_positions,
                       f"the target's max_position_embeddings={shape.max_positions}: "
                       "train refuses longer samples"))
    rows = drafter_rows(cfg)
    if rows.num_anchors * rows.block_size > rows.budget:  # beyond this length one sample needs more rows
        bounds.append((rows.budget // rows.block_size + 1,
                       f"data.row_budget={rows.budget}: longer samples need more drafter rows, "
                       "and train refuses them"))
    return min(bounds, key=lambda bound: bound[0])


def _roles(sizes: _Sizes, step: StepMeasure, b: int, s: int, rows: int) -> dict[str, list[tuple[str, int]]]:
    """The consumers of each role's device at its peak: a colocated rank; or a disaggregated
    job's drafter rank, its drafter rank 0 when it evaluates, and its target rank."""
    cfg, shape = sizes.cfg, sizes.shape
    chunk_rows = min(cfg.objective.loss_chunk_size or rows, rows)
    # [chunk, V] logits in the compute dtype, their fp32 copy and (bf16) the gradient cast back
    head = chunk_rows * shape.vocab * (4 + 2 * sizes.dtype_bytes if sizes.dtype_bytes < 4 else 4)
    activations = max(0, step.peak - step.weights - step.grads - step.optimizer - step.autocast_cache - head)
    drafter = [("drafter weights (fp32 master)", step.weights), ("drafter gradients (fp32)", step.grads),
               ("AdamW state (fp32)", step.optimizer), ("bf16 autocast weight cache", step.autocast_cache),
               ("drafter saved activations + temporaries (measured)", activations),
               (f"LM head + CE chunk ({chunk_rows} x {shape.vocab})", head)]
    weights = sizes.target_weights()
    forward = sizes.target_forward(b, s)
    engine = ("vLLM engine on this device (target.vllm_gpu_memory_utilization of it)", sizes.engine_share)
    if cfg.pipeline.placement == "disaggregated":
        received = ("features in flight (the step it trains)", sizes.features(b, s, "drafter"))
        roles = {"drafter rank": [
            ("target embedding + LM head", target_weight_bytes(shape, cfg, sizes.dtype_bytes, True)),
            *drafter, received]}
        if evaluates(cfg):  # drafter rank 0 decodes the evals with the whole target (never sharded there)
            whole = shape.params * sizes.dtype_bytes
            roles["drafter rank 0 (evals)"] = [
                ("target weights (whole: drafter rank 0 runs the evals)", whole), *drafter, received]
        links = f"{sizes.links} drafter link{'s' if sizes.links > 1 else ''}"
        roles["target rank"] = [weights, ("target forward (no grad, transient)", forward),
                                (f"features in flight ({links}, {sizes.steps_held('target')} steps)",
                                 sizes.features(b, s, "target")), engine]
        return roles
    features = ("features in flight", sizes.features(b, s, "colocated"))
    if cfg.pipeline.enabled:  # the next micro-batch's target forward runs beside this step
        return {"colocated rank": [weights, *drafter, features,
                                   ("target forward (no grad, overlapping the step)", forward), engine]}
    # sequential: the target forward runs between steps, in the memory the step frees
    return {"colocated rank": [weights, *drafter, features,
                               ("target forward beyond the step's transient", forward - activations - head),
                               engine]}


def _notes(cfg: Config, dev: str) -> list[str]:
    notes = ["attention kernels modelled (saved tensors of the real kernel); the rest of the drafter's step "
             "measured on fake tensors"]
    if dev == "cuda" and cfg.drafter.attention in ("auto", "flex") and not cfg.drafter.attention_sink:
        notes.append("flex attention's block mask (sparse tables built from the anchors, a few MiB) "
                     "is not counted")
    if cfg.target.backend == "vllm":
        notes.append("target.backend=vllm: the engine's weights, KV cache and activations are vLLM's own "
                     "plan (target.vllm_gpu_memory_utilization of each of target.vllm_devices" +
                     (": GPUs of its own, not counted here; naming this rank's own GPU, lower the "
                      "utilization to leave it the rest)" if cfg.target.vllm_devices else
                      "; none set: it runs on this rank's GPU, counted above)")
                     + ("; the start-up feature check briefly loads the whole target in-process on this "
                        "device (target.vllm_check_samples=0 skips it)"
                        if cfg.target.vllm_check_samples else ""))
    return notes


def _advice(cfg: Config, plan: MemoryPlan, parts: dict[str, int]) -> list[str]:
    """What to change, largest lever first, when the plan does not fit (or is within 10 %)."""
    usable = plan.device_bytes * (1 - MemoryPlan.MARGIN)
    if plan.peak_bytes <= 0.9 * usable:
        return []
    over = plan.peak_bytes - 0.9 * usable  # down to 90 % of the usable memory: some room to spare
    advice = []
    weights = next((v for name, v in parts.items() if name.startswith("target weights")), 0)
    if plan.role == "drafter rank 0 (evals)" and weights > 0.3 * usable:  # the largest lever: first
        advice.append("leave eval.data_path and eval.prompts_path empty: drafter rank 0 then holds the "
                      "target's embedding and LM head only; evaluate the export with `flashdraft eval` on "
                      "its own GPUs")
    dynamic = sum(v for name, v in parts.items() if "activations" in name or "chunk" in name)
    bs = cfg.drafter.block_size
    if dynamic > 0.05 * usable and plan.rows > bs:
        keep = 1 - over / dynamic if dynamic > over else 0.25
        rows = max(bs, int(plan.rows * keep) // bs * bs)
        enough = "" if dynamic > over else f" (saves ~{(1 - keep) * dynamic / GiB:.0f} GiB; not enough alone)"
        advice.append(f"lower data.row_budget (now {cfg.data.row_budget}) to about {rows}: fewer drafter "
                      f"rows per micro-batch{enough}")
        per = max(1, int(anchors_per_pass(cfg, plan.seq_len) * keep))
        advice.append(f"or set objective.anchors_per_microbatch={per}: the same loss in slices (recomputes "
                      "the context K/V per slice)")
        if not cfg.drafter.activation_checkpointing:
            advice.append("or set drafter.activation_checkpointing=true: recompute each drafter layer in "
                          "backward (~30% slower)")
    if weights > 0.3 * usable and plan.role in ("colocated rank", "target rank"):
        elsewhere = ", or pipeline.placement=disaggregated (the target on its own ranks)" \
            if plan.role == "colocated rank" else ""
        advice.append(f"shard the target: target.tensor_parallel={2 * cfg.target.tensor_parallel} (now "
                      f"{cfg.target.tensor_parallel}){elsewhere}")
    in_flight = sum(v for name, v in parts.items() if name.startswith("features in flight"))
    if in_flight > 0.1 * usable:
        advice.append(f"lower data.token_budget (now {cfg.data.token_budget}) or pipeline.capacity (now "
                      f"{cfg.pipeline.capacity}): fewer target features in flight")
    if cfg.objective.loss_chunk_size == 0 or cfg.objective.loss_chunk_size > 1024:
        advice.append("set objective.loss_chunk_size=1024: one smaller LM-head chunk at a time")
    need = plan.peak_bytes / (1 - MemoryPlan.MARGIN)
    advice.append(f"or a device with at least {need / GiB:.0f} GiB")
    return advice


def device_memory(device: torch.device) -> int | None:
    """The device's memory in bytes (None on CPU: no device limit)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def check_fits(cfg: Config, device: torch.device, world_size: int = 1) -> MemoryPlan | None:
    """The start-up check, before the trainer loads any weights. With a device memory limit (CUDA):
    the plan at the worst length for the job of ``world_size`` ranks (every role's peak: a rank
    refuses a run any rank of it cannot hold), and a run that cannot fit refused (ValueError with
    the plan and what to change) unless train.memory_check is off. Without one (CPU) there is
    nothing to refuse: no plan is made (its fake steps would cost every CPU start-up ~1 s);
    `flashdraft plan` estimates a CPU or GPU run on request."""
    total = device_memory(device)
    if total is None:
        return None
    plan = plan_memory(cfg, device_bytes=total, device=device.type, world_size=world_size)
    if not plan.fits and cfg.train.memory_check:
        raise ValueError(f"the memory plan says this run cannot fit the device ({total / GiB:.1f} GiB): "
                         "change what it advises, or set train.memory_check=false to try anyway\n"
                         f"{plan.format()}")
    log.info("%s", plan.format())
    return plan


# ---- `flashdraft plan` ----------------------------------------------------------------------


def add_arguments(parser) -> None:
    import argparse

    from flashdraft.config import describe_fields

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = describe_fields()
    parser.add_argument("--config", help="YAML config file (as for `flashdraft train`)")
    parser.add_argument("--device-memory", type=float, default=None,
                        help="the device's memory in GiB (default: the visible GPU's, else none)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="plan at this padded length (default: the worst up to data.max_length)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="the job's ranks, torchrun's nnodes x nproc-per-node (default: $WORLD_SIZE); a "
                             "disaggregated plan needs it: a target rank holds features for each drafter "
                             "rank it feeds")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides, e.g. data.row_budget=8192 target.path=DIR")


def run(args) -> int:
    """Print the plan's table, verdict and advice; exit 0 when the run fits, 1 when it does not."""
    from flashdraft.config import load_config

    cfg = load_config(args.config, args.overrides)
    device_bytes = None
    if args.device_memory is not None:
        # nan and inf too: a device's memory is a finite number of GiB
        if not 0 < args.device_memory <= 2**20:
            raise ValueError(f"--device-memory {args.device_memory}: give the device's memory in GiB, a "
                             "positive number up to 1048576, e.g. 80")
        device_bytes = int(args.device_memory * GiB)
    elif torch.cuda.is_available() and cfg.train.device != "cpu":
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    world_size = args.world_size or (int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE") else None)
    plan = plan_memory(cfg, device_bytes=device_bytes, seq_len=args.seq_len, world_size=world_size)
    print(plan.format())
    return 0 if plan.fits else 1


