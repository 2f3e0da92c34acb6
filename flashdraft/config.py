"""Typed run configuration: frozen dataclasses, a YAML file plus dotted overrides.

Every knob is declared once, here, with its default and a one-line doc. ``load_config`` reads
an optional YAML file, applies ``section.field=value`` overrides (values parsed as YAML, so
``optim.lr=3e-4`` and ``target.layer_ids=[1,3]`` work), coerces them to the declared
types and validates; every error names the field and the fix. The resolved config is saved as
YAML next to every output (``save_config``).

The config is the leaf of the package: it imports only the standard library and yaml, so every
module may import it. What its checks need is therefore declared here and imported by the owners:
the choice lists, each drafter layer's attention pattern (``LayerMask``) with the sight rule
(``blind_slots``), and marks on fields (``RESUME``, ``DFLASH2``) from which lists of fields are derived.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import math
import os
import reprlib
import textwrap
import tokenize
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# ---- the choice lists: declared here, where the config validates them at load; each owner --------
# imports its list from here (the config imports nothing from the package, so it stays a leaf)
DTYPES = ("auto", "bfloat16", "float32", "float16")  # compute dtypes: auto is bf16 on GPU, fp32 on CPU
DRAFTERS = ("dflash", "dflash2")  # drafter.family: the drafter family
ATTENTION_IMPLS = ("auto", "dense", "split", "blockwise", "flex")  # drafter.attention
# the implementations with an attention sink (flex has none)
SINK_IMPLS = ("auto", "dense", "split", "blockwise")
LAYER_TYPES = ("full_attention", "sliding_attention")  # the drafter layer kinds (config.json layer_types)
ON_INVALID = ("raise", "drop")  # data.on_invalid: what a bad sample does (data.dataset)
WEIGHTINGS = ("decay", "dpace")  # objective.weighting: exp(-(k-1)/gamma), or D-PACE (objective.dpace_weights)
LOSSES = ("ce", "tv", "lk_lambda")  # objective.loss: what each weighted slot contributes (objective.SlotLoss)
DEVICES = ("auto", "cuda", "cpu")  # train.device: auto is CUDA when available, else CPU (distributed)
METRIC_SINKS = ("jsonl", "tensorboard", "wandb")  # train.metrics (metrics.MetricsLogger)
# pipeline.placement: every rank runs target + drafter, or target ranks feed drafter ranks
# (distributed.role_layout)
PLACEMENTS = ("colocated", "disaggregated")
# target.backend: who computes the target's features (transformers in-process, or a vLLM engine:
# target.engine)
TARGET_BACKENDS = ("transformers", "vllm")
# The smallest positive temperature: logits / T must stay finite in fp32 (|logit| <= ~1e34 * T), and
# far below it sampling is greedy anyway. Smaller positive values are refused where they are given
# (eval.temperature at config load, --temperature at parse), not turned into greedy silently:
# greedy decoding checks losslessness and reports other fields, so 0 must be asked for.
MIN_TEMPERATURE = 1e-4
# The longest timeout any *_timeout_s field takes (about 31 years): beyond it the clocks and the
# timedelta it is given to overflow (1e308 was a traceback at start-up).
MAX_TIMEOUT_S = 1e9

# ---- marks on fields: the lists of fields other parts need are derived from them (marked_fields) --
RESUME = "resume"  # a resume must find the field unchanged: it changes what is trained or in which order
DFLASH2 = "dflash2"  # a DFlash2 knob: refused unless drafter.family=dflash2 (it would be ignored)
VLLM = "vllm"  # a knob of the vLLM target backend: refused unless target.backend=vllm (it would be ignored)


def _marked(default: Any, *marks: str) -> Any:
    """A field's default, with ``marks`` (RESUME, DFLASH2) in its metadata."""
    return field(default=default, metadata=dict.fromkeys(marks, True))


@dataclass(frozen=True)
class TargetConfig:
    path: str = ""  # local directory of the Hugging Face target model (config.json + weights)
    # tapped target layers; None: DFlash default spread
    layer_ids: tuple[int, ...] | None = _marked(None, RESUME)
    num_taps: int = _marked(5, RESUME)  # number of tapped layers when layer_ids is None
    dtype: str = "auto"  # target/drafter compute dtype: auto (bf16 on GPU, fp32 on CPU), bfloat16, float32
    attn_implementation: str = "sdpa"  # Hugging Face attention backend for the target
    trust_remote_code: bool = False  # allow the target directory's own Python code (off: safer)
    # ranks each target is sharded over (transformers' TP plan); the world a multiple of it
    tensor_parallel: int = 1
    # with tensor_parallel > 1: a MoE target's experts split over the group instead
    expert_parallel: bool = False
    # ---- the target's backend: who computes the features (target.backend, the vllm_* knobs) ----
    # transformers (in-process forward) | vllm (a vLLM engine in its own process; docs/architecture.md)
    backend: str = "transformers"  # who computes the target's features
    # interpreter with vLLM installed ("": flashdraft's cached CPU build)
    vllm_python: str = _marked("", VLLM)
    vllm_tensor_parallel: int = _marked(1, VLLM)  # the engine's tensor_parallel_size (GPUs of its own)
    vllm_expert_parallel: bool = _marked(False, VLLM)  # the engine's enable_expert_parallel (a MoE target)
    # the engine's quantization, e.g. fp8 ("": the checkpoint's own)
    vllm_quantization: str = _marked("", VLLM)
    vllm_gpu_memory_utilization: float = _marked(0.9, VLLM)  # share of each engine GPU's memory vLLM may take
    vllm_max_model_len: int = _marked(0, VLLM)  # the engine's max_model_len (0: data.max_length + 1)
    # the engine's CUDA_VISIBLE_DEVICES, e.g. "4,5,6,7" ("": the rank's own GPU)
    vllm_devices: str = _marked("", VLLM)
    # samples compared tap by tap with the in-process transformers forward at start-up (0: none)
    vllm_check_samples: int = _marked(4, VLLM)

    def __post_init__(self):
        _check_finite(self, "target")
        _check(self.num_taps >= 1, "target.num_taps", f"{self.num_taps}", "use 1 or more")
        _check(self.dtype in DTYPES, "target.dtype", self.dtype, f"use one of {', '.join(DTYPES)}")
        _check(self.tensor_parallel >= 1, "target.tensor_parallel", f"{self.tensor_parallel}",
               "use 1 (every rank holds the whole target) or the ranks to shard it over, e.g. 8")
        _check(not self.expert_parallel or self.tensor_parallel > 1, "target.expert_parallel", "true",
               "expert parallelism splits the experts over a target group: "
               "set target.tensor_parallel > 1 too")
        _check(self.backend in TARGET_BACKENDS, "target.backend", self.backend,
               f"use {' or '.join(TARGET_BACKENDS)}")
        _check(self.vllm_tensor_parallel >= 1, "target.vllm_tensor_parallel", f"{self.vllm_tensor_parallel}",
               "use 1 or the engine's GPUs to shard the target over")
        _check(0 < self.vllm_gpu_memory_utilization <= 1, "target.vllm_gpu_memory_utilization",
               f"{self.vllm_gpu_memory_utilization}", "use a share in (0, 1], e.g. 0.9")
        for key in ("vllm_max_model_len", "vllm_check_samples"):
            _check(getattr(self, key) >= 0, f"target.{key}", f"{getattr(self, key)}", "use 0 or more")
        if self.layer_ids is not None:
            ids = self.layer_ids
            _check(len(ids) > 0 and len(set(ids)) == len(ids) and min(ids) >= 0, "target.layer_ids",
                   f"{list(ids)}", "give distinct non-negative layer ids, e.g. [1, 9, 17, 25, 33]")
        _refuse_unselected([(self, "target", tuple(f.name for f in dataclasses.fields(self)
                                                   if f.metadata.get(VLLM)))],
                           self.backend == "vllm", "the vLLM target backend", "set target.backend=vllm too")
        if self.backend == "vllm":
            _check(self.tensor_parallel == 1, "target.tensor_parallel", f"{self.tensor_parallel}",
                   "with target.backend=vllm the engine shards the target: use target.vllm_tensor_parallel")


@dataclass(frozen=True)
class DrafterConfig:
    # drafter family: dflash | dflash2 (conv around every sublayer + candidate selector)
    family: str = _marked("dflash", RESUME)
    num_layers: int = _marked(5, RESUME)  # drafter decoder layers (5 for Qwen3-4B/8B drafts)
    block_size: int = _marked(16, RESUME)  # tokens per drafted block (anchor + block_size - 1 masks)
    # id of the mask token; None: the tokenizer's <|MASK|> / mask_token
    mask_token_id: int | None = _marked(None, RESUME)
    # auto: flex on CUDA, else blockwise
    attention: str = "auto"  # drafter training attention: auto, blockwise, split, flex, dense (oracle)
    # recompute drafter layers in backward: less activation memory, ~30% slower
    activation_checkpointing: bool = False
    # one per drafter layer, or one for all: full_attention | sliding_attention; empty: all full (DFlash v1)
    layer_types: tuple[str, ...] = _marked(
        (), RESUME)  # drafter layer kinds; e.g. [sliding_attention] (DFlash2's)
    # window of the sliding layers in tokens, the query counted (e.g. 2048)
    sliding_window: int | None = _marked(None, RESUME)
    # in-block causality of every layer; null: sliding causal, full not
    causal: bool | None = _marked(None, RESUME)
    # a learnable per-head attention sink logit in every drafter layer
    attention_sink: bool = _marked(False, RESUME)
    # start from a released drafter (its serving-format directory: a flashdraft export, z-lab's, SpecForge's);
    # its shape comes from its config.json, and a drafter.* key set otherwise is refused ("": random init)
    init_from: str = _marked("", RESUME)
    # dflash2: the conv's taps along the block's slots (1 .. block_size)
    conv_kernel_size: int = _marked(2, RESUME, DFLASH2)
    # dflash2: channels sharing one dynamic kernel (must divide the hidden size)
    conv_group_size: int = _marked(16, RESUME, DFLASH2)
    # dflash2: rank of the selector's predecessor x successor codebooks
    selector_rank: int = _marked(256, RESUME, DFLASH2)
    # dflash2: candidates per slot the selector re-ranks (the head's top-k)
    selector_top_k: int = _marked(16, RESUME, DFLASH2)

    @property
    def per_layer_types(self) -> list[str] | None:
        """The drafter's layer kinds, one per layer (None: DFlash v1's full layers)."""
        types = list(self.layer_types)
        return types * self.num_layers if len(types) == 1 else types or None

    def __post_init__(self):
        _check_finite(self, "drafter")
        _check(self.block_size >= 2, "drafter.block_size", f"{self.block_size}",
               "use 2 or more (16 is the published default)")
        _check(self.num_layers >= 1, "drafter.num_layers", f"{self.num_layers}", "use 1 or more")
        _check(self.attention in ATTENTION_IMPLS, "drafter.attention", self.attention,
               f"use one of {', '.join(ATTENTION_IMPLS)}")
        _check(not self.attention_sink or self.attention in SINK_IMPLS, "drafter.attention",
               self.attention, f"flex has no attention sink (drafter.attention_sink=true): use one of "
               f"{', '.join(SINK_IMPLS)} (auto trains sinks blockwise on CUDA, in fp32 under autocast)")
        _check(self.mask_token_id is None or self.mask_token_id >= 0, "drafter.mask_token_id",
               f"{self.mask_token_id}",
               "use an unused id inside the target's vocabulary (Qwen3: 151669), or null for the tokenizer's "
               "<|MASK|>")
        types = self.layer_types
        _check(all(t in LAYER_TYPES for t in types) and len(types) in (0, 1, self.num_layers),
               "drafter.layer_types", f"{list(types)}",
               f"give one of {', '.join(LAYER_TYPES)} per drafter layer ({self.num_layers}), or one for all")
        sliding = "sliding_attention" in types
        _check(sliding == (self.sliding_window is not None) and
               (self.sliding_window is None or self.sliding_window >= 1),
               "drafter.sliding_window", f"{self.sliding_window}",
               "give a positive window (e.g. 2048) exactly when a layer is sliding_attention")
        if sliding and self.sliding_window >= 1:
            layers = [LayerMask(self.sliding_window if t == "sliding_attention" else None)
                      for t in self.per_layer_types]
            blind = blind_slots(layers, self.block_size)  # only ever in an all-sliding stack
            if blind:
                _check(False, "drafter.sliding_window", f"{self.sliding_window}",
                       f"with drafter.block_size {self.block_size} and {len(layers)} sliding layer(s), "
                       f"block slots {_slot_span(blind)} can see no target feature in any layer (not through "
                       f"the window, not through another slot); use a window of "
                       f"{smallest_sighted_window(layers, self.block_size)} "
                       "or more (2048 is the released drafters'), or make a layer full_attention")
        _check(self.family in DRAFTERS, "drafter.family", self.family, f"use one of {', '.join(DRAFTERS)}")
        _check(1 <= self.conv_kernel_size <= self.block_size, "drafter.conv_kernel_size",
               f"{self.conv_kernel_size}",
               f"use 1 .. drafter.block_size ({self.block_size}); 2 is the released drafters'")
        for key in ("conv_group_size", "selector_rank", "selector_top_k"):
            _check(getattr(self, key) >= 1, f"drafter.{key}", f"{getattr(self, key)}", "use 1 or more")


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # training data: a token shard, a HF save_to_disk dir or parquet files
    max_length: int = _marked(3072, RESUME)  # samples longer than this are truncated (tokens)
    # max padded tokens per micro-batch (batch_size x padded length)
    token_budget: int = _marked(16384, RESUME)
    max_batch_size: int = _marked(64, RESUME)  # max samples per micro-batch
    row_budget: int = 32768  # max drafter rows (anchors x block_size, summed over samples) per micro-batch
    min_supervised: int | None = None  # min supervised tokens per sample; None: 2 * block_size
    on_invalid: str = "raise"  # bad samples: raise (with index and fix) or drop (counted, reported)

    def __post_init__(self):
        _check_finite(self, "data")
        _check(self.max_length >= 2, "data.max_length", f"{self.max_length}", "use at least 2 * block_size")
        _check(self.min_supervised is None or self.min_supervised >= 0, "data.min_supervised",
               f"{self.min_supervised}",
               "use 0 or more supervised tokens, or null for 2 * drafter.block_size")
        _check(self.token_budget >= 1, "data.token_budget", f"{self.token_budget}",
               "use a positive token count")
        _check(self.max_batch_size >= 1, "data.max_batch_size", f"{self.max_batch_size}", "use 1 or more")
        _check(self.row_budget >= 1, "data.row_budget", f"{self.row_budget}", "use a positive row count")
        _check(self.on_invalid in ON_INVALID, "data.on_invalid", self.on_invalid,
               f"use one of {', '.join(ON_INVALID)}")


@dataclass(frozen=True)
class ObjectiveConfig:
    num_anchors: int = 512  # anchored blocks per sequence, re-drawn every step
    # slot weights: decay (exp(-(k-1)/gamma)) | dpace (confidence-based, detached; D-PACE)
    weighting: str = "decay"
    # slot decay exp(-(k-1)/gamma); 0: published default for the block (7 for 16); null: none
    gamma: float | None = 0.0
    # D-PACE's floor on each slot's confidence, in (0, 1] (0.5: the paper's; 1: linear decay)
    dpace_alpha: float = 0.5
    # per-slot loss: ce (= LK^alpha for hard labels) | tv (1 - q(label)) | lk_lambda (CE/TV mix)
    loss: str = "ce"
    # lk_lambda: lambda = lk_kl_scale * exp(-lk_kl_decay * mean q(label)), per forward
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 1.0  # lk_lambda: how fast lambda falls as the drafter gets confident
    # block slots per LM-head + CE chunk (0: all); 1024 x 151,936 fp32 logits = 0.6 GB
    loss_chunk_size: int = 1024
    # anchors per fwd+bwd slice (0: all); same loss, less memory, recomputes ctx KV
    anchors_per_microbatch: int = 0
    # (1 - kd_weight) * CE + kd_weight * T^2 * KL(target || drafter); 0: hard labels only
    # soft labels: the share of each slot's loss that is the KL from the target's own distribution
    kd_weight: float = 0.0
    kd_temperature: float = 1.0  # soft labels: the temperature T of both distributions in the KL
    # a block's slots after its first missed slot weigh auf_factor (Spec-AUF; docs/recipes.md: the default)
    accept_until_fail: bool = _marked(True, RESUME)
    # accept_until_fail: the weight of those slots (0: dropped; 1: off)
    auf_factor: float = _marked(0.0, RESUME)
    # dflash2: weight of the selector's CE over its candidates (0: selector frozen)
    selector_alpha: float = _marked(1.0, DFLASH2)
    # dflash2: the selector term is off for this share of the steps ...
    selector_warmup_frac: float = _marked(0.0, DFLASH2)
    # ... then rises linearly to selector_alpha over this share
    selector_ramp_frac: float = _marked(0.0, DFLASH2)
    # dflash2: the selector CE trains the selector only (not the backbone)
    selector_stop_gradient: bool = _marked(False, DFLASH2)

    def __post_init__(self):
        _check_finite(self, "objective")
        _check(self.num_anchors >= 1, "objective.num_anchors", f"{self.num_anchors}",
               "use 1 or more (512 default)")
        _check(self.gamma is None or self.gamma >= 0, "objective.gamma", f"{self.gamma}",
               "use a positive decay (7 for block 16, 5 for 10, 4 for 8) or null to disable")
        _check(self.weighting in WEIGHTINGS, "objective.weighting", self.weighting,
               f"use one of {', '.join(WEIGHTINGS)}")
        _check(0 < self.dpace_alpha <= 1, "objective.dpace_alpha", f"{self.dpace_alpha}",
               "use a value in (0, 1], e.g. 0.5")
        _check(self.loss in LOSSES, "objective.loss", self.loss, f"use one of {', '.join(LOSSES)}")
        _check(self.lk_kl_scale >= 0 and self.lk_kl_decay >= 0, "objective.lk_kl_scale / lk_kl_decay",
               f"{self.lk_kl_scale} / {self.lk_kl_decay}",
               "use values >= 0 (1.0 / 1.0: SpecForge's defaults)")
        _check(self.loss_chunk_size >= 0, "objective.loss_chunk_size", f"{self.loss_chunk_size}",
               "use 0 or more")
        _check(self.anchors_per_microbatch >= 0, "objective.anchors_per_microbatch",
               f"{self.anchors_per_microbatch}",
               "use 0 (all anchors in one pass) or a positive anchor count, e.g. 128")
        _check(0 <= self.kd_weight <= 1, "objective.kd_weight", f"{self.kd_weight}",
               "use a share in [0, 1]: 0 trains on hard labels only, 1 on the target's distribution only")
        _check(self.kd_weight == 0 or self.loss == "ce", "objective.loss", self.loss,
               "soft labels (objective.kd_weight > 0) mix the KL with CE: use objective.loss=ce with them")
        _check(self.kd_temperature >= MIN_TEMPERATURE, "objective.kd_temperature", f"{self.kd_temperature}",
               f"use a temperature of at least {MIN_TEMPERATURE:g}, e.g. 1.0 "
               "(the serving temperature's scale)")
        _check(0 <= self.auf_factor <= 1, "objective.auf_factor", f"{self.auf_factor}",
               "use a weight in [0, 1] for the slots after a block's first miss (0: dropped)")
        _refuse_unselected([(self, "objective", ("kd_temperature",))], self.kd_weight > 0,
                           "the soft labels' temperature", "set objective.kd_weight above 0 too")
        _refuse_unselected([(self, "objective", ("auf_factor",))], self.accept_until_fail,
                           "accept-until-fail's weight", "set objective.accept_until_fail=true too")
        _check(self.selector_alpha >= 0, "objective.selector_alpha", f"{self.selector_alpha}",
               "use 0 (selector frozen) or a positive weight (1.0: SpecForge's and speculators')")
        _check(min(self.selector_warmup_frac, self.selector_ramp_frac) >= 0
               and self.selector_warmup_frac + self.selector_ramp_frac <= 1,
               "objective.selector_warmup_frac / selector_ramp_frac",
               f"{self.selector_warmup_frac} / {self.selector_ramp_frac}",
               "use shares of the run that add up to at most 1 (else selector_alpha is never reached)")
        _refuse_unselected([(self, "objective", ("dpace_alpha",))], self.weighting == "dpace",
                           "D-PACE's slot weights", "set objective.weighting=dpace too")
        _refuse_unselected([(self, "objective", ("gamma",))], self.weighting == "decay",
                           "the decay slot weights", "set objective.weighting=decay too")
        _refuse_unselected([(self, "objective", ("lk_kl_scale", "lk_kl_decay"))], self.loss == "lk_lambda",
                           "the LK lambda mix", "set objective.loss=lk_lambda too")
        _refuse_unselected([(self, "objective", ("selector_warmup_frac", "selector_ramp_frac",
                                                 "selector_stop_gradient"))], self.selector_alpha > 0,
                           "the selector term's schedule",
                           "set objective.selector_alpha above 0 too (0 freezes the selector)")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4  # peak learning rate (AdamW)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_frac: float = 0.04  # linear warmup over this share of all steps, then cosine to 0
    grad_clip: float = 1.0  # max global grad norm (0 disables clipping)
    init_std: float = 0.02  # std of the drafter's normal init

    def __post_init__(self):
        _check_finite(self, "optim")
        _check(self.lr > 0, "optim.lr", f"{self.lr}", "use a positive learning rate, e.g. 6e-4")
        _check(0 <= self.warmup_frac < 1, "optim.warmup_frac", f"{self.warmup_frac}", "use a share in [0, 1)")
        _check(self.grad_clip >= 0, "optim.grad_clip", f"{self.grad_clip}", "use 0 (off) or a positive norm")
        _check(all(0 <= b < 1 for b in self.betas), "optim.betas", f"{list(self.betas)}",
               "use two numbers in [0, 1), e.g. [0.9, 0.999]")
        _check(self.weight_decay >= 0, "optim.weight_decay", f"{self.weight_decay}",
               "use 0 (the recipe) or more")
        _check(self.init_std > 0, "optim.init_std", f"{self.init_std}", "use a positive std, e.g. 0.02")


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = "runs/flashdraft"  # checkpoints, exports, metrics and the resolved config
    epochs: int = 6  # passes over the training data
    max_steps: int | None = None  # stop after this many optimizer steps (None: run all epochs)
    seed: int = _marked(0, RESUME)  # seeds init, data order and anchor sampling
    log_every: int = 10  # steps between metric lines
    grad_accum: int = 1  # micro-batches per optimizer step (gradient sync only on the last)
    device: str = "auto"  # auto (cuda if available), cuda or cpu
    metrics: tuple[str, ...] = ("jsonl",)  # metric sinks: jsonl, tensorboard, wandb
    collective_timeout_s: float = 600.0  # a dead or hung rank fails the others after this long
    max_nonfinite_steps: int = 20  # skipped non-finite steps tolerated before the run stops
    deterministic: bool = False  # torch deterministic algorithms (exact resume tests)
    # CPU training: glibc keeps freed activations for reuse (false: glibc default)
    # reusing freed activations means no page faults each step
    keep_freed_host_memory: bool = True
    # CUDA: refuse a run the memory plan (`flashdraft plan`) says cannot fit (false: try)
    memory_check: bool = True
    # how long ranks wait for each other at start-up (loading, data, resume)
    startup_timeout_s: float = 3600.0
    # how long ranks wait for rank 0's checkpoint save (write, hash, export) or eval
    pause_timeout_s: float = 3600.0

    def __post_init__(self):
        _check_finite(self, "train")
        _check(self.epochs >= 1, "train.epochs", f"{self.epochs}", "use 1 or more")
        _check(self.seed >= 0, "train.seed", f"{self.seed}",
               "use 0 or more (numpy's seed sequences refuse negatives)")
        _check(bool(str(self.output_dir).strip()), "train.output_dir", "''",
               "give the run's directory (checkpoints, metrics), e.g. runs/my-run")
        _check(self.max_steps is None or self.max_steps >= 1, "train.max_steps", f"{self.max_steps}",
               "use 1 or more")
        _check(self.log_every >= 1, "train.log_every", f"{self.log_every}", "use 1 or more")
        _check(self.grad_accum >= 1, "train.grad_accum", f"{self.grad_accum}", "use 1 or more")
        _check(self.device in DEVICES, "train.device", self.device, f"use one of {', '.join(DEVICES)}")
        bad = [m for m in self.metrics if m not in METRIC_SINKS]
        _check(not bad, "train.metrics", f"{list(self.metrics)}", f"use any of {', '.join(METRIC_SINKS)}")
        _check(0 < self.collective_timeout_s <= MAX_TIMEOUT_S, "train.collective_timeout_s",
               f"{self.collective_timeout_s}", f"use a positive number of seconds up to {MAX_TIMEOUT_S:g}")
        _check(0 < self.startup_timeout_s <= MAX_TIMEOUT_S, "train.startup_timeout_s",
               f"{self.startup_timeout_s}",
               f"use a positive number of seconds up to {MAX_TIMEOUT_S:g} (e.g. 3600: loading a large target "
               "from shared storage)")
        _check(0 < self.pause_timeout_s <= MAX_TIMEOUT_S, "train.pause_timeout_s", f"{self.pause_timeout_s}",
               f"use a positive number of seconds up to {MAX_TIMEOUT_S:g} (e.g. 3600: writing and hashing a "
               "checkpoint of tens of GB)")


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 500  # steps between checkpoints (0: only at the end)
    keep_last: int = 3  # checkpoints kept on disk
    resume: str = "auto"  # auto (latest checkpoint in train.output_dir, if any), never, or a checkpoint dir

    def __post_init__(self):
        _check(self.save_every >= 0, "checkpoint.save_every", f"{self.save_every}",
               "use 0 (only at the end) or more")
        _check(self.resume in ("auto", "never") or os.path.isdir(self.resume), "checkpoint.resume",
               self.resume, "use auto, never, or an existing checkpoint directory")
        _check(self.keep_last >= 1, "checkpoint.keep_last", f"{self.keep_last}", "keep at least 1 checkpoint")


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # steps between evaluations (0: only at the end)
    data_path: str = ""  # held-out data for eval loss/accuracy ("" = none)
    prompts_path: str = ""  # JSONL of {"input_ids": [...]} prompts for tau ("" = from data_path)
    num_prompts: int = 8  # held-out prompts for the real draft/verify tau
    max_new_tokens: int = 64  # tokens generated per eval prompt
    temperature: float = 0.0  # the eval's sampling temperature (0: greedy; > 0: rejection-sampled verify)
    top_p: float = 1.0  # the eval's nucleus for the target (1: off)
    top_k: int = 0  # the eval's top-k for the target (0: off)

    def __post_init__(self):
        _check_finite(self, "eval")
        _check(self.every >= 0, "eval.every", f"{self.every}", "use 0 (only at the end) or more")
        _check(self.num_prompts >= 0 and self.max_new_tokens >= 1, "eval.num_prompts / max_new_tokens",
               f"{self.num_prompts} / {self.max_new_tokens}", "use 0 or more prompts and 1 or more tokens")
        _check(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE, "eval.temperature",
               f"{self.temperature}",
               f"use 0 (greedy) or a temperature of at least {MIN_TEMPERATURE:g} (smaller "
               "ones overflow the logits), e.g. 1.0")
        _check(0 < self.top_p <= 1, "eval.top_p", f"{self.top_p}", "use a value in (0, 1] (1: off)")
        _check(self.top_k >= 0, "eval.top_k", f"{self.top_k}", "use 0 (off) or a positive count")
        _check(self.temperature > 0 or (self.top_p == 1 and self.top_k == 0),
               "eval.top_p / top_k", f"{self.top_p} / {self.top_k}",
               "they shape sampling: set eval.temperature above 0 with them (0 is greedy)")


@dataclass(frozen=True)
class PipelineConfig:
    enabled: bool = True  # run data, target forward and drafter step as overlapped stages (false: sequential)
    capacity: int = 2  # items each bounded channel holds (how far a stage may run ahead of the next)
    # colocated (target + drafter per rank) or disaggregated (target ranks feed drafters)
    placement: str = "colocated"
    # disaggregated: the last N ranks run data + target; each feeds (world - N) / N drafter ranks
    target_ranks: int = 1
    # RAM budget (bytes/process) of the cross-epoch target-feature cache (0: no RAM tier)
    feature_cache_bytes: int = 0
    # disk budget (bytes/process) for the cache beyond the RAM tier (0: no disk tier)
    feature_cache_disk_bytes: int = 0
    feature_cache_dir: str = ""  # directory of the disk tier's scratch files ("": node-local $TMPDIR or /tmp)
    join_timeout_s: float = 5.0  # how long shutdown waits for stage threads before logging the stragglers

    def __post_init__(self):
        _check_finite(self, "pipeline")
        _check(self.capacity >= 1, "pipeline.capacity", f"{self.capacity}",
               "use 1 or more (2 is enough to overlap)")
        _check(self.placement in PLACEMENTS, "pipeline.placement", self.placement,
               f"use {' or '.join(PLACEMENTS)}")
        _check(self.target_ranks >= 1, "pipeline.target_ranks", f"{self.target_ranks}",
               "use 1 or more target ranks (with pipeline.placement=disaggregated)")
        _check(self.feature_cache_bytes >= 0, "pipeline.feature_cache_bytes", f"{self.feature_cache_bytes}",
               "use 0 (off) or a RAM budget in bytes, e.g. 8e9 "
               "(`flashdraft bench pipeline` prints what a full cache needs)")
        _check(self.feature_cache_disk_bytes >= 0, "pipeline.feature_cache_disk_bytes",
               f"{self.feature_cache_disk_bytes}", "use 0 (off) or a disk budget in bytes, e.g. 2e11")
        _check(not self.feature_cache_dir or self.feature_cache_disk_bytes > 0, "pipeline.feature_cache_dir",
               self.feature_cache_dir,
               "it is only used by the disk tier: set pipeline.feature_cache_disk_bytes too, or drop it")
        cache = ("pipeline.feature_cache_bytes", self.feature_cache_bytes) if self.feature_cache_bytes else \
            ("pipeline.feature_cache_disk_bytes", self.feature_cache_disk_bytes)  # the tier that is set
        _check(self.placement == "colocated" or not cache[1], cache[0], f"{cache[1]}",
               "the feature cache (both tiers) runs in the colocated target stage only; set it to 0 with "
               "placement=disaggregated")
        _check(0 < self.join_timeout_s <= MAX_TIMEOUT_S, "pipeline.join_timeout_s", f"{self.join_timeout_s}",
               f"use a positive number of seconds up to {MAX_TIMEOUT_S:g}")


@dataclass(frozen=True)
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self):
        # Cross-section checks; each section validated its own fields already.
        dflash2 = [(getattr(self, name), name, tuple(k for s, k in marked_fields(DFLASH2) if s == name))
                   for name, _ in _sections()]
        _refuse_unselected(dflash2, self.drafter.family == "dflash2", "DFlash2's conv and selector",
                           "set drafter.family=dflash2 too")
        if self.target.backend == "vllm":
            self._check_vllm_backend()
        if self.target.tensor_parallel > 1:
            _check(self.pipeline.placement == "colocated"
                   or not (self.eval.data_path or self.eval.prompts_path),
                   "eval.data_path / eval.prompts_path", self.eval.data_path or self.eval.prompts_path,
                   "a disaggregated job's evals run on a drafter rank, which cannot hold a target that needs "
                   "target.tensor_parallel: leave them empty and run `flashdraft eval --tensor-parallel N` "
                   "on the export, or train colocated")
            ram, disk = self.pipeline.feature_cache_bytes, self.pipeline.feature_cache_disk_bytes
            _check(not (ram or disk),
                   "pipeline.feature_cache_bytes" if ram else "pipeline.feature_cache_disk_bytes",
                   f"{ram or disk}",
                   "the feature cache is not used with a tensor-parallel target: set both tiers to 0")
        _check(self.drafter.block_size <= self.data.max_length, "drafter.block_size",
               f"{self.drafter.block_size}",
               f"a block cannot be longer than a sample (data.max_length={self.data.max_length}): lower "
               "drafter.block_size or raise data.max_length")
        if self.data.min_supervised is None:
            need = 2 * self.drafter.block_size
            _check(self.data.max_length >= need, "data.max_length", f"{self.data.max_length}",
                   f"every sample needs 2 * drafter.block_size = {need} supervised tokens "
                   f"(DFlash's filter), so use data.max_length >= {need}, or set data.min_supervised "
                   "explicitly")

    def _check_vllm_backend(self) -> None:
        """What the vLLM target backend cannot do (yet): decode (the in-training tau), or give the
        target's final normed state (the soft labels); the engine shards the target itself
        (TargetConfig refuses target.tensor_parallel)."""
        _check(self.objective.kd_weight == 0, "objective.kd_weight", f"{self.objective.kd_weight}",
               "soft labels need the target's final normed state, which the vLLM engine cannot capture (it "
               "records the stream entering a layer, before the final norm): set objective.kd_weight=0, "
               "or use target.backend=transformers")
        tau = bool(self.eval.prompts_path or self.eval.data_path) and self.eval.num_prompts > 0
        _check(not tau, "eval.num_prompts", f"{self.eval.num_prompts}",
               "the in-training tau decodes with the target in-process, which target.backend=vllm does not "
               "load: set eval.num_prompts=0 (the held-out loss of eval.data_path still runs) and judge "
               "the export with `flashdraft eval --engine vllm`")

    def to_dict(self) -> dict:
        return _to_plain(dataclasses.asdict(self))


# ---- the keys renamed when the sections were cut by owner (issue 37) ------------------------------
# The one old -> new table: a user's YAML or override with an old key is refused naming the new one
# (_refuse_renamed); a config this tool saved before (a checkpoint's config.json) is translated
# (upgrade_saved), so an old checkpoint still resumes and exports.
RENAMED = {
    "model.target": "target.path",
    "model.target_layer_ids": "target.layer_ids",
    "model.num_taps": "target.num_taps",
    "model.dtype": "target.dtype",
    "model.attn_implementation": "target.attn_implementation",
    "model.trust_remote_code": "target.trust_remote_code",
    "model.tensor_parallel": "target.tensor_parallel",
    "model.expert_parallel": "target.expert_parallel",
    "model.target_backend": "target.backend",
    **{f"model.vllm_{k}": f"target.vllm_{k}" for k in (
        "python", "tensor_parallel", "expert_parallel", "quantization", "gpu_memory_utilization",
        "max_model_len", "devices", "check_samples")},
    "model.drafter": "drafter.family",
    "model.num_draft_layers": "drafter.num_layers",
    "model.block_size": "drafter.block_size",
    "model.mask_token_id": "drafter.mask_token_id",
    "model.drafter_attention": "drafter.attention",
    "model.activation_checkpointing": "drafter.activation_checkpointing",
    "model.drafter_layer_types": "drafter.layer_types",
    "model.drafter_sliding_window": "drafter.sliding_window",
    "model.drafter_causal": "drafter.causal",
    "model.drafter_attention_sink": "drafter.attention_sink",
    "model.init_from": "drafter.init_from",
    "model.conv_kernel_size": "drafter.conv_kernel_size",
    "model.conv_group_size": "drafter.conv_group_size",
    "model.selector_rank": "drafter.selector_rank",
    "model.selector_top_k": "drafter.selector_top_k",
    "train.save_every": "checkpoint.save_every",
    "train.keep_last": "checkpoint.keep_last",
    "train.resume": "checkpoint.resume",
    "train.eval_every": "eval.every",
    "train.eval_prompts": "eval.num_prompts",
    "train.eval_max_new_tokens": "eval.max_new_tokens",
    "train.eval_temperature": "eval.temperature",
    "train.eval_top_p": "eval.top_p",
    "train.eval_top_k": "eval.top_k",
    "data.eval_path": "eval.data_path",
    "data.eval_prompts": "eval.prompts_path",
}
_REMOVED_SECTIONS = {"model": "target and drafter"}  # a section no key lives in any more: where its keys went


def _refuse_renamed(values: Mapping) -> None:
    """ValueError naming the new key of every renamed key in ``values`` (a YAML file and overrides,
    nested by section), and the sections of a removed one."""
    old = [f"{section}.{key}" for section, fields in values.items() if isinstance(fields, Mapping)
           for key in fields if f"{section}.{key}" in RENAMED]
    if old:
        raise ValueError(f"config {', '.join(f'{k} was renamed {RENAMED[k]}' for k in old)}; write "
                         f"{'them' if len(old) > 1 else 'it'} so (`flashdraft config` prints every field)")
    for section, where in _REMOVED_SECTIONS.items():
        if section in values:
            fields = values[section]
            known = (", ".join(f"{section}.{k}" for k in fields) if isinstance(fields, Mapping) and fields
                     else section)
            raise ValueError(f"config {known}: the {section} section was split into {where}; move its keys "
                             "there (`flashdraft config` prints every field)")


def upgrade_saved(values: Mapping) -> dict:
    """A config this tool saved (``Config.to_dict``, a checkpoint's config.json) in today's
    sections: each renamed key moved to its new name (a key given under both keeps the new one),
    sections left empty dropped. A config in today's sections comes back unchanged."""
    out = {section: dict(fields) if isinstance(fields, Mapping) else fields
           for section, fields in values.items()}
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        fields = out.get(old_section)
        if isinstance(fields, dict) and old_key in fields:
            value = fields.pop(old_key)
            out.setdefault(new_section, {}).setdefault(new_key, value)
    for section in _REMOVED_SECTIONS:
        if out.get(section) == {}:
            del out[section]
    return out


def marked_fields(mark: str) -> list[tuple[str, str]]:
    """(section, field) of every field marked ``mark`` (RESUME, DFLASH2), in declaration order:
    the lists other parts need are derived from the marks, so a new field is listed where it is declared."""
    return [(section, f.name) for section, cls in _sections() for f in dataclasses.fields(cls)
            if f.metadata.get(mark)]


# What a run whose saved config predates a key trained with, where today's default differs:
# accept-until-fail became the default objective after it existed as an option (docs/recipes.md).
DEFAULT_BEFORE = {("objective", "accept_until_fail"): False}


def resume_changes(saved: Mapping, current: Mapping) -> list[str]:
    """What a resume would silently change: each field marked RESUME (it changes what is trained
    or in which order) that the run's config ``current`` sets otherwise than the checkpoint's
    ``saved`` one (both as ``Config.to_dict`` gives them), as "section.key: checkpoint X vs now Y".
    A key the saved config predates had its default then, or, where the default changed since,
    the value DEFAULT_BEFORE records. (The batch plan's own inputs, data.row_budget and
    objective.num_anchors among them, are checked by the data cursor too: BatchSampler.PLAN_KEYS.)"""
    defaults = Config().to_dict()
    then = {(s, k): saved.get(s, {}).get(k, DEFAULT_BEFORE.get((s, k), defaults[s][k]))
            for s, k in marked_fields(RESUME)}
    return [f"{s}.{k}: checkpoint {was!r} vs now {current[s][k]!r}"
            for (s, k), was in then.items() if was != current[s][k]]


# ---- a model's config.json: the sizes anything is built from, bounded -----------------------------
# A target's config.json (target.model.read_model_config) and a drafter export's (drafter.serving)
# are checked by this one rule before anything is built from them. Each bound is far beyond any
# released model (Llama-3.1-405B: 126 layers, hidden 16,384, 128 heads; Qwen3-Next: 512 experts;
# Gemma 3: 262,144 tokens), and low enough that a mistyped size is one line, not minutes of layers
# built on the meta device or an allocation of terabytes.
MODEL_SIZES = {  # field: (smallest, largest); a field a config leaves out is the model class's default
    "num_hidden_layers": (1, 1024), "num_target_layers": (1, 1024), "hidden_size": (1, 65536),
    "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024), "head_dim": (1, 4096),
    "intermediate_size": (1, 1 << 20), "moe_intermediate_size": (1, 1 << 20), "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 30), "num_experts": (0, 4096), "num_local_experts": (0, 4096),
    "n_routed_experts": (0, 4096), "num_experts_per_tok": (0, 4096),
}
# null: the model class derives or drops them
_DERIVED_WHEN_NULL = ("num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                      "num_local_experts", "n_routed_experts", "num_experts_per_tok")
MODEL_NESTING = ("text_config",)  # a multimodal config's language model, checked by the same rule


def check_model_sizes(values: Mapping, where: str, prefix: str = "") -> None:
    """ValueError naming ``where`` (the file) and the field when a size in the model config
    ``values`` (config.json as a dict) is not a whole number within MODEL_SIZES, when the
    key-value heads do not divide the attention heads, or when a token is routed to more experts
    than there are; nested language-model configs (MODEL_NESTING) likewise."""
    for key, (low, high) in MODEL_SIZES.items():
        if key not in values or (values[key] is None and key in _DERIVED_WHEN_NULL):
            continue
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{where}: {prefix}{key}={_shown(value)} is invalid: a "
                             f"{'size' if low else 'count'} is a whole number from {low} to {high:,} (a "
                             "larger one is beyond any model flashdraft can build); fix the model's "
                             "config.json")
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ValueError(f"{where}: {prefix}num_key_value_heads={kv} does not divide "
                         f"{prefix}num_attention_heads={heads} (each key-value head serves a whole group of "
                         "query heads); fix the model's config.json")
    experts = max((values.get(k) or 0 for k in ("num_experts", "num_local_experts", "n_routed_experts")),
                  default=0)
    per_token = values.get("num_experts_per_tok") or 0
    if experts and per_token > experts:
        raise ValueError(f"{where}: {prefix}num_experts_per_tok={per_token} routes each token to more "
                         f"experts than the {experts} there are; fix the model's config.json")
    for nested in MODEL_NESTING:
        if isinstance(values.get(nested), Mapping):
            check_model_sizes(values[nested], where, f"{prefix}{nested}.")


# ---- each drafter layer's attention pattern, and the rule the config checks it by --------------
# Pure Python, so the config checks a window at load; drafter.attention builds its masks from
# LayerMask, and drafter.serving checks an export by the same rule.

@dataclass(frozen=True)
class LayerMask:
    """One layer's attention pattern (DFLASH2.md section 3.1): a query at position p = a + k (block
    anchored at a, slot k) sees a key at position kv only if p - kv < ``window`` (None: no
    window; HF convention, the query counts), and, ``causal``, in-block slots <= k only.
    Context keys are always kv < a. Full DFlash v1 layers: LayerMask() (every slot of the block)."""

    window: int | None = None
    causal: bool = False


def blind_slots(layers: list[LayerMask], block_size: int) -> list[int]:
    """The scored slots (1 .. block_size - 1) whose output can depend on no context row, i.e. on
    none of the target's features, under ``layers`` (first to last).

    A slot k (query position a + k) sees context in a layer when the row a - 1 is in its window:
    k + 1 < W, every slot in a full layer. It also learns what an in-block slot it sees in that layer
    already learnt in an earlier one, and keeps it (the residual stream). So context spreads from the
    slots that see it by up to W - 1 slots a layer: an all-sliding stack of L layers reaches every
    slot iff L * (W - 1) >= block_size; a single full layer reaches them all."""
    informed = [False] * block_size
    for layer in layers:
        window = block_size + 1 if layer.window is None else layer.window  # a full layer: every row in reach
        # slot k sees the in-block slots j with k - j < window (and j <= k when causal)
        informed = [informed[k] or k + 1 < window
                    or any(informed[max(0, k - window + 1):k + 1 if layer.causal else block_size])
                    for k in range(block_size)]
    return [k for k in range(1, block_size) if not informed[k]]


def smallest_sighted_window(layers: list[LayerMask], block_size: int) -> int:
    """The smallest window that, given to every sliding layer of ``layers``, leaves no slot blind."""
    return next(w for w in range(2, block_size + 2)
                if not blind_slots([LayerMask(w if m.window is not None else None, m.causal) for m in layers],
                                   block_size))


def _check_finite(section, name: str) -> None:
    """Every float of a section is finite: inf and nan pass range checks (inf > 0) and then break
    a run hours later (a JSON checkpoint cannot hold them, an infinite lr skips every step)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, tuple) else (value,)
        _check(all(math.isfinite(v) for v in values if isinstance(v, float)), f"{name}.{f.name}", f"{value}",
               "give a finite number")


def _refuse_unselected(sections, selected: bool, option: str, select: str) -> None:
    """Knobs of an option that is not selected would be ignored without a word, so they are refused
    (the rule for every such knob: DFlash2's sizes on a DFlash drafter, D-PACE's alpha with decay
    weights, gamma with D-PACE, the LK mix's scale with ce / tv, the selector's schedule with the
    selector frozen). ``sections``: (section, its name, the option's knobs); a knob counts as set
    when its value differs from the declared default (a saved config, which writes every field,
    loads back). ``select``: how to select ``option`` ("set drafter.family=dflash2 too")."""
    if selected:
        return
    given = [f"{name}.{key}={_yaml_value(getattr(section, key))}"
             for section, name, keys in sections for key in keys
             if getattr(section, key) != _default(type(section), key)]
    if given:
        many = len(given) > 1
        raise ValueError(f"config {', '.join(given)} {'are' if many else 'is'} ignored: "
                         f"{'they configure' if many else 'it configures'} {option}, which this config "
                         f"does not select; {select}, or drop {'them' if many else 'it'}")


def _default(cls, key: str) -> Any:
    f = cls.__dataclass_fields__[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _slot_span(slots: list[int]) -> str:
    """``[5, 6, 7]`` as ``5..7`` (blind slots are always a run to the block's end), one as itself."""
    return f"{slots[0]}..{slots[-1]}" if len(slots) > 1 else f"{slots[0]}"


def _check(ok: bool, name: str, value: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"config {name}={value} is invalid: {fix}")


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_plain(v) for v in obj]
    return obj


@dataclass(frozen=True)
class _Override:
    """A dotted override's value: its text as typed, and that text parsed as YAML (None when it
    does not parse). A string field takes the text (``data.path=yes`` stays "yes", a ``#`` stays
    in the path); any other field the parsed value."""

    text: str
    parsed: Any
    error: str = ""


def _shown(value: Any) -> str:
    """``value`` for an error message, bounded: a YAML alias bomb or a deeply nested value is
    shown abridged (``[[[...], ...], ...]``), never expanded (that took minutes and all memory)."""
    shown = reprlib.Repr()  # its limits as attributes: Python 3.10's takes no arguments
    (shown.maxlevel, shown.maxlist, shown.maxtuple, shown.maxdict, shown.maxstring,
     shown.maxother) = 2, 4, 4, 4, 60, 60
    return shown.repr(value)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a YAML-parsed value to the declared field type, or raise naming the field."""
    if isinstance(value, _Override):
        text = value.text.strip()
        if tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                         and str in typing.get_args(tp) and text not in ("null", "~", "")):
            quoted = text[:1] in ("'", '"') and isinstance(value.parsed, str)
            return value.parsed if quoted else text  # a quoted YAML string loses its quotes, as in a file
        if value.error:
            raise ValueError(f"config {name}={_shown(value.text)} is invalid: {value.error}")
        value = value.parsed
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"config {name}: cannot be null")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            args = typing.get_args(tp)
            example = " of names, e.g. [a, b]" if args[0] is str else ", e.g. [1, 2]"
            raise ValueError(f"config {name}={_shown(value)} is invalid: give a list{example}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], name) for v in value)
        if len(args) != len(value):
            raise ValueError(f"config {name}={_shown(value)} is invalid: give exactly {len(args)} values")
        return tuple(_coerce(v, a, name) for v, a in zip(value, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config {name}={_shown(value)} is invalid: use true or false")
    if tp is int:
        if isinstance(value, str):  # YAML 1.1 reads 64e9 (no dot) as a string: byte budgets are written so
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise ValueError(f"config {name}={_shown(value)} is invalid: give an integer")
            value = int(value)
        if not -2**63 <= value < 2**63:  # every count ends up in an int64 tensor, a C long or a seed
            raise ValueError(f"config {name}={_shown(value)} is invalid: give an integer below 2**63 (a "
                             "larger one overflows the tensors and generators it reaches)")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"config {name}={_shown(value)} is invalid: give a number")
        if not math.isfinite(value):  # inf / nan pass every range check below, then break the run
            raise ValueError(f"config {name}={_shown(value)} is invalid: give a finite number")
        return float(value)
    if tp is str:
        if value is None or isinstance(value, dict | list):
            raise ValueError(f"config {name}={_shown(value)} is invalid: give a string")
        return str(value)
    raise TypeError(f"config {name}: unsupported field type {tp}")


def _build(cls, values: dict, prefix: str):
    if not prefix:
        _refuse_renamed(values)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"config: unknown key {prefix}{unknown[0]}; known keys of {prefix.rstrip('.') or 'the config'}: "
            f"{', '.join(sorted(known))}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        tp, value = hints[f.name], values[f.name]
        if dataclasses.is_dataclass(tp):
            if value is None:  # `drafter:` with every field commented out
                value = {}
            if not isinstance(value, dict):
                raise ValueError(f"config {prefix}{f.name} must be a mapping of its fields")
            kwargs[f.name] = _build(tp, value, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(value, tp, f"{prefix}{f.name}")
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """['optim.lr=3e-4', 'drafter.block_size=8'] -> {'optim': {'lr': _Override('3e-4', 3e-4)}, ...}: each
    value keeps its text beside its YAML parse (see _Override)."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not of the form section.field=value (e.g. optim.lr=3e-4)")
        try:
            parsed, error = (yaml.safe_load(raw) if raw.strip() else ""), ""
        except yaml.YAMLError as exc:
            parsed, error = None, f"not valid YAML ({getattr(exc, 'problem', None) or exc})"
        except RecursionError:
            parsed, error = None, "nested too deeply (a few levels are all any field takes)"
        _put(tree, key, _Override(raw, parsed, error))
    return tree


def _put(tree: dict, key: str, value: Any) -> None:
    """``tree[section][field] = value`` for a dotted ``key`` ('optim.lr'), making the sections."""
    *sections, name = key.strip().split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[name] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last
    silently: `lr: 1e-3` below `lr: 6e-4` would win without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None,
                                                        f"key {key!r} given twice in one mapping; keep one",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Config:
    """Resolve a Config from defaults < ``base`` < YAML file < dotted overrides."""
    values = dict(base or {})
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start}); give a YAML "
                             "config file") from None
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the config file ({exc.strerror}); give an existing "
                             "YAML file, e.g. one written by `flashdraft config > run.yaml`") from None
        try:
            loaded = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        except RecursionError:
            raise ValueError(f"{path}: nested too deeply for a config file (a few levels are all any field "
                             "takes); fix the file (`flashdraft config` prints a valid one)") from None
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            raise ValueError(f"{path}: not valid YAML{at} ({getattr(exc, 'problem', None) or exc}); fix "
                             "the file (`flashdraft config` prints a valid one)") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file must be a YAML mapping of sections "
                             "(target, drafter, data, ...)")
        values = _merge(values, loaded)
    values = _merge(values, parse_overrides(overrides or []))
    return _build(Config, values, "")


def config_from_dict(values: dict, dotted: Mapping[str, Any] | None = None) -> Config:
    """A Config from nested ``values`` ({'optim': {'lr': 3e-4}}), with the ``dotted`` keys
    ({'optim.lr': 3e-4}, typed values) over them."""
    extra: dict = {}
    for key, value in (dotted or {}).items():
        _put(extra, key, value)
    return _build(Config, _merge(values, extra), "")


def save_config(config: Config, path: str | Path) -> None:
    """The resolved config as documented YAML (``to_yaml``): what ``--config`` reads back."""
    Path(path).write_text(to_yaml(config))


# ---- the fields' documentation: the comments on the fields above, read from this source -------

@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Each field of the config dataclass ``cls`` -> its one-line doc: the comment on the field's
    line, then any comment lines right above it (the source is the documentation, so help texts
    cannot drift from it), a divider (``# ---- ...``) above a group of fields aside."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # installed without its .py sources: no docs, nothing else lost
        return {f.name: "" for f in dataclasses.fields(cls)}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT and not tok.string.lstrip("#").strip().startswith("----")}
    body = ast.parse(source).body[0]
    docs, previous_end = {}, body.lineno
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above = [comments[line] for line in range(previous_end + 1, node.lineno) if line in comments]
            pieces = [comments.get(node.end_lineno, ""), *above]
            docs[node.target.id] = "; ".join(c.rstrip(";") for c in pieces if c)
        previous_end = node.end_lineno
    return docs


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def _yaml_value(value: Any) -> str:
    """``value`` as one flow-style YAML scalar or list (what ``load_config`` parses back)."""
    return yaml.safe_dump({"v": _to_plain(value)}, default_flow_style=True, width=10**9).strip()[4:-1]


def _documented_fields(config: Config):
    """(section, field, the field's value in ``config``, its doc) of every field, in order."""
    for section, cls in _sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            yield section, f, getattr(getattr(config, section), f.name), docs[f.name]


def describe_fields() -> str:
    """Every field of every section: ``section.field: type = default`` and its doc (for --help)."""
    lines, current = ["config fields (in a --config YAML file, or as section.field=value overrides):"], None
    for section, f, default, doc in _documented_fields(Config()):
        if section != current:
            lines.append(f"\n  {section}:")
            current = section
        lines += [f"    {section}.{f.name}: {f.type} = {_yaml_value(default)}", f"        {doc}"]
    return "\n".join(lines)


def to_yaml(config: Config) -> str:
    """The config as YAML with each field's doc as a comment; ``load_config`` reads it back to ``config``."""
    lines = ["# flashdraft run config (`flashdraft config` prints the defaults; edit, then --config FILE)"]
    current = None
    for section, f, value, doc in _documented_fields(config):
        if section != current:
            lines.append(f"{section}:")
            current = section
        lines.append(f"  {f.name}: {_yaml_value(value)}  # {doc}")
    return "\n".join(lines) + "\n"


# ---- `flashdraft config` --------------------------------------------------------------------


def add_arguments(parser) -> None:
    import argparse

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = describe_fields()
    parser.add_argument("--config",
                        help="YAML config file to start from (sections target, drafter, data, ...)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 target.path=DIR")


def run(args) -> int:
    """Print the resolved, validated config as documented YAML: `flashdraft config > run.yaml`."""
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0
