"""A rank's start-up, shared by the trainer and a disaggregated target rank: the process, the
checks of the run's inputs, the frozen target and the data.

Both roles run the same checks in the same order, so a refused input fails every rank alike,
before the ranks meet (``meet``) and long before any weights move or a step runs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from flashdraft import distributed
from flashdraft.config import Config
from flashdraft.data.batching import BatchSampler
from flashdraft.data.dataset import TokenDataset, open_dataset
from flashdraft.distributed import Dist
from flashdraft.target import TargetModel
from flashdraft.target.engine import last_layer_warning
from flashdraft.train import checks, plan
from flashdraft.train.runtime import deterministic_mode, keep_freed_host_memory

log = logging.getLogger(__name__)


def start_process(config: Config) -> Dist:
    """This process's place in the job: the process group joined (its role, its device), with
    the process-wide settings the config asks for."""
    cfg = config
    # before init_distributed touches CUDA: cuBLAS reads its workspace setting once
    if cfg.train.deterministic:
        deterministic_mode()
    disaggregated = cfg.pipeline.placement == "disaggregated"
    dist = distributed.init_distributed(cfg.train.device, cfg.train.collective_timeout_s,
                                        num_target_ranks=cfg.pipeline.target_ranks if disaggregated else 0,
                                        tensor_parallel=cfg.target.tensor_parallel,
                                        startup_timeout_s=cfg.train.startup_timeout_s,
                                        pause_timeout_s=cfg.train.pause_timeout_s)
    if dist.device.type == "cpu" and cfg.train.keep_freed_host_memory and keep_freed_host_memory():
        log.debug("glibc malloc keeps freed memory for reuse (CPU training)")
    return dist


def with_init_from(config: Config) -> Config:
    """``config`` with its drafter's shape taken from the released drafter it starts from
    (drafter.init_from; unchanged without one): its taps, layers, block, MASK id, attention and
    family (drafter.serving.config_fields). A target.* or drafter.* key set to another value than the
    export's is refused by name, and so is an export made for another target (hidden size,
    vocabulary, depth), before any weights load."""
    init_from = config.drafter.init_from
    if not init_from:
        return config
    from transformers import AutoConfig

    from flashdraft.drafter import serving
    from flashdraft.target.model import _model_dir

    export = serving.read_config(init_from)
    try:
        fields = serving.config_fields(export)
    except ValueError as exc:
        raise ValueError(f"drafter.init_from={init_from}: {exc}") from None
    for section, values in fields.items():
        mine, defaults = getattr(config, section), type(getattr(config, section))()
        for key, value in values.items():
            if getattr(mine, key) != getattr(defaults, key) and getattr(mine, key) != value:
                raise ValueError(f"{section}.{key}={_shown(getattr(mine, key))} disagrees with the drafter "
                                 f"in drafter.init_from={init_from} ({_shown(value)}): drop {section}.{key}, "
                                 "the drafter's shape comes from drafter.init_from")
    target = AutoConfig.from_pretrained(_model_dir(config.target.path),
                                        trust_remote_code=config.target.trust_remote_code)
    target = target.get_text_config() if hasattr(target, "get_text_config") else target
    wanted = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
              "num_target_layers": target.num_hidden_layers}
    diffs = [f"{k} {export.get(k)} vs {v}" for k, v in wanted.items() if export.get(k) not in (None, v)]
    if diffs:
        raise ValueError(f"drafter.init_from={init_from} was trained for another target than target.path="
                         f"{config.target.path} ({', '.join(diffs)}: drafter vs target); start from a "
                         "drafter of this target, or from scratch (drafter.init_from='')")
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)
                                          for section, values in fields.items()})


def _shown(value) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def check_run(config: Config, dist: Dist) -> None:
    """The checks that need no weights: paths, the drafter's sizes and, on a GPU, the memory plan
    of every role of the job (a run that cannot fit its device is refused in seconds, not after
    loading the target)."""
    checks.check_paths(config)
    checks.check_drafter_sizes(config, dist.device)
    plan.check_fits(config, dist.device, dist.job_world_size)


def load_target(config: Config, dist: Dist) -> TargetModel:
    """The frozen target on this rank's device: whole, sharded over a target group (its
    tensor- / expert-parallel plan), or on a disaggregated drafter rank the embedding and LM head
    only (the loss's share of it; the rank that runs evals loads it all).

    The one place that picks the target backend (target.backend): with ``vllm`` a rank that
    computes features (colocated, or a disaggregated target rank) gets an EngineTarget, whose
    features a vLLM engine computes; a drafter rank's heads are in-process either way. The feed
    and the loop see only the target's face (``features``, ``lock``, ``close``)."""
    cfg = config
    if cfg.target.backend == "vllm" and dist.role != "drafter":
        return _engine_target(cfg, dist)
    evaluates = dist.is_main and plan.evaluates(cfg)  # the memory plan counts the same rule
    target = TargetModel.from_pretrained(
        cfg.target.path, target_layer_ids=cfg.target.layer_ids, num_taps=cfg.target.num_taps,
        device=dist.device, dtype=cfg.target.dtype, attn_implementation=cfg.target.attn_implementation,
        trust_remote_code=cfg.target.trust_remote_code, heads_only=dist.role == "drafter" and not evaluates,
        final_state=cfg.objective.kd_weight > 0,  # soft labels: the target's final states follow its taps
        **({} if dist.role == "drafter" else  # a disaggregated drafter rank: the (whole) heads only
           {"tensor_parallel": cfg.target.tensor_parallel, "expert_parallel": cfg.target.expert_parallel}),
    )
    if dist.is_main:  # a last-layer tap: the engines would serve other features than these
        last_layer_tap = last_layer_warning(target.layer_ids, target.num_layers)
        if last_layer_tap:
            log.warning("warning: %s", last_layer_tap)
    if target.sharded and dist.rank == 0:  # the first rank of the first target group
        local, whole = target.weight_bytes()
        log.warning("target sharded over %d ranks per group (%s parallel): %.2f GiB of its weights on each "
                    "rank (%.2f GiB unsharded), plus the gathered embedding and LM head the drafter uses",
                    cfg.target.tensor_parallel, "expert" if cfg.target.expert_parallel else "tensor",
                    local / 2**30, whole / 2**30)
    return target


def _engine_target(cfg: Config, dist: Dist):
    """The target whose features a vLLM engine computes (flashdraft.target.engine): its heads on
    this rank's device, the engine started on the same directory in the run's dtype."""
    from flashdraft.target.engine import EngineOptions, EngineTarget

    return EngineTarget.from_pretrained(
        cfg.target.path, target_layer_ids=cfg.target.layer_ids, num_taps=cfg.target.num_taps,
        device=dist.device, dtype=cfg.target.dtype, max_model_len=cfg.data.max_length + 1,
        options=EngineOptions.of(cfg.target), trust_remote_code=cfg.target.trust_remote_code)


def check_engine(cfg: Config, target, dataset: TokenDataset) -> None:
    """An engine target's features against the in-process forward on the first
    ``target.vllm_check_samples`` samples of the run's data, before the run trusts them
    (flashdraft.target.feature_check; a mismatch stops the run naming the tap, sample and error).
    The transformers target is loaded for the check alone, on this rank's device, and freed."""
    from flashdraft.target.feature_check import check_engine_features

    count = min(cfg.target.vllm_check_samples, len(dataset))
    if count == 0:
        log.warning("warning: the vLLM engine's features are not checked (target.vllm_check_samples=0)")
        return
    reference = TargetModel.from_pretrained(
        cfg.target.path, target_layer_ids=target.layer_ids, device=target.device, dtype=cfg.target.dtype,
        attn_implementation=cfg.target.attn_implementation, trust_remote_code=cfg.target.trust_remote_code)
    try:
        report = check_engine_features(target, reference, [dataset[i][0].tolist() for i in range(count)])
    finally:
        del reference
        if target.device.type == "cuda":
            torch.cuda.empty_cache()
    errors = ", ".join(f"layer {t['layer']}: {t['relative_error']:.1e}" for t in report["taps"])
    log.info("the vLLM engine's features match the in-process forward on %d samples (%d tokens): largest "
             "relative error per tap %s (tolerance %.0e in %s)", report["samples"], report["tokens"], errors,
             report["tolerance"], report["dtype"])


def close_target(target) -> None:
    """End what the target holds beyond this process (an engine target's engine process ends with
    the run, not when the target is collected); nothing for a TargetModel or None."""
    close = getattr(target, "close", None)
    if close is not None:
        close()


@dataclass
class RunData:
    """The run's training and held-out data, and its eval prompts (token ids)."""

    dataset: TokenDataset
    eval_dataset: TokenDataset | None
    eval_prompt_ids: list[list[int]]


def open_data(config: Config, dist: Dist, target: TargetModel, mask_token_id: int) -> RunData:
    """The training and held-out data and prompts, checked now rather than hours into the run."""
    cfg = config
    min_supervised = (cfg.data.min_supervised if cfg.data.min_supervised is not None
                      else 2 * cfg.drafter.block_size)
    open_kw = dict(vocab_size=target.config.vocab_size, max_length=cfg.data.max_length,
                   min_supervised=min_supervised, on_invalid=cfg.data.on_invalid, progress=dist.is_main)
    dataset = open_dataset(cfg.data.path, **open_kw)
    eval_dataset = open_dataset(cfg.eval.data_path, **open_kw) if cfg.eval.data_path else None
    checks.check_tokenizer(cfg.target.path, dataset, eval_dataset)
    checks.check_mask_token(dataset, mask_token_id)
    for found in (dataset, eval_dataset):
        if found is not None:
            checks.check_lengths(found, cfg, target.config)
    # an engine's features are checked before they are trusted
    if getattr(target, "backend", None) == "vllm":
        check_engine(cfg, target, dataset)
    return RunData(dataset, eval_dataset, checks.load_eval_prompts(cfg, eval_dataset, target.config))


def batch_plan(config: Config, dataset: TokenDataset, rank: int, world_size: int) -> BatchSampler:
    """The training batch plan of data rank ``rank`` of ``world_size`` (a disaggregated target
    rank builds the plan of each drafter rank it feeds, from the rank and world size its HELLO
    names): ``train.epochs`` passes over the data, or endless when ``train.max_steps`` sets the
    budget. Each micro-batch stays within the target's token budget and the drafter's row budget."""
    return _within_budgets(config, dataset, seed=config.train.seed, rank=rank, world_size=world_size,
                           num_epochs=None if config.train.max_steps else config.train.epochs)


def eval_plan(config: Config, eval_dataset: TokenDataset) -> BatchSampler:
    """The held-out loss's batches: the training budgets, one fixed order (seed 0), every rank alike."""
    return _within_budgets(config, eval_dataset, seed=0)


def _within_budgets(config: Config, dataset: TokenDataset, **plan) -> BatchSampler:
    """A batch plan of ``dataset`` under the run's token, batch-size and drafter-row budgets."""
    return BatchSampler(dataset.lengths, token_budget=config.data.token_budget,
                        max_batch_size=config.data.max_batch_size, rows=checks.drafter_rows(config), **plan)


def meet() -> None:
    """Every rank of the job (both roles) read the target and the data from shared storage at
    its own pace, and the main rank verified the checkpoint to resume from: meet host-side,
    under train.startup_timeout_s, before the first device collective (DDP's broadcast)."""
    distributed.startup_barrier("loading the target and the data, "
                                "and verifying the checkpoint to resume from")
