"""Start-up checks of the run's inputs: everything a run can refuse before it trains a step.

Each check raises ValueError naming the file (or field) and the fix, so a mistake costs
seconds at start-up rather than hours into a run.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch

from flashdraft.config import Config
from flashdraft.data.batching import DrafterRows, check_row_budget

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def target_tokenizer(target_dir: str):
    """The target directory's tokenizer, loaded once per start-up for the MASK-id lookup and the
    data's tokenizer check (a 152K-entry tokenizer takes about a second). Failures are not cached."""
    from pathlib import Path

    from transformers import AutoTokenizer

    # transformers "loads" a 1-token tokenizer from a model directory without tokenizer files, so
    # every check below would report a mismatch instead of the missing files
    if not any((Path(target_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{target_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(target_dir)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_mask_token_id(configured: int | None, target_dir: str) -> int:
    """The configured id, else the tokenizer's <|MASK|> (DFlash's convention) or mask_token."""
    if configured is not None:
        return configured
    try:
        tokenizer = target_tokenizer(str(target_dir))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{target_dir}: no tokenizer to find the mask token in ({exc}); "
                         "set drafter.mask_token_id") from None
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab:
        return vocab["<|MASK|>"]
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    raise ValueError(
        f"{target_dir}: the tokenizer has no <|MASK|> or mask token; set drafter.mask_token_id to an unused "
        "id inside the target's embedding table (Qwen3: 151669, the id <|MASK|> gets when added)"
    )


def check_paths(cfg: Config) -> None:
    if not cfg.target.path:
        raise ValueError("config target.path is empty: give the Hugging Face target directory "
                         "(target.path=DIR)")
    if not cfg.data.path:
        raise ValueError("config data.path is empty: give the training data "
                         "(data.path=DIR, see `flashdraft prepare`)")
    _check_output_dir(cfg)


def _check_output_dir(cfg: Config) -> None:
    """train.output_dir receives checkpoints, metrics and a lock file: never the target's directory
    or a path inside it, one of the run's data files or inside a data directory (a checkpoint
    written there would change what the next run reads), nor inside any run's checkpoints or
    another run's own outputs (its export, its logs: flashdraft.outputs.RUN_OUTPUTS)."""
    from flashdraft.outputs import checkpoints_around, run_output_around

    out = Path(cfg.train.output_dir).resolve()
    protected = checkpoints_around(out)
    if protected is not None:
        raise ValueError(f"train.output_dir {cfg.train.output_dir} lies inside {protected}, a training run's "
                         "checkpoints; give a directory outside it")
    own = run_output_around(out)
    if own is not None:
        raise ValueError(f"train.output_dir {cfg.train.output_dir} is or lies inside {own}, an output of the "
                         f"training run in {own.parent} (its {own.name}); give a directory outside it")
    for field, given in (("target.path", cfg.target.path), ("data.path", cfg.data.path),
                         ("eval.data_path", cfg.eval.data_path),
                         ("eval.prompts_path", cfg.eval.prompts_path)):
        if given and out.is_relative_to(Path(given).resolve()):
            raise ValueError(f"train.output_dir {cfg.train.output_dir} is or lies inside {field} {given}, "
                             "which the run reads and its checkpoints and metrics would be written into; "
                             "give another directory")


def check_drafter_sizes(cfg: Config, device=None) -> None:
    """DFlash2's sizes against the target's config.json, before the target loads (a sharded one
    takes minutes): the conv's groups must split the hidden size, the selector's candidates fit
    in the vocabulary, and the selector's training state (fp32 codebooks and projection, their
    gradients and AdamW's two moments: 16 bytes a parameter) fits in ``device``'s memory (a
    rank of 1e9 was an allocator traceback for terabytes)."""
    if cfg.drafter.family != "dflash2":
        return
    from transformers import AutoConfig

    from flashdraft.target.model import _model_dir

    target = AutoConfig.from_pretrained(_model_dir(cfg.target.path, cfg.target.trust_remote_code),
                                        trust_remote_code=cfg.target.trust_remote_code)
    target = target.get_text_config() if hasattr(target, "get_text_config") else target
    hidden, vocab = int(target.hidden_size), int(target.vocab_size)
    if hidden % cfg.drafter.conv_group_size:
        fits = [g for g in (16, 8, 32, 64, 4, 2) if hidden % g == 0]  # the released 16 first
        raise ValueError(f"drafter.conv_group_size={cfg.drafter.conv_group_size} must divide the target's "
                         f"hidden size {hidden}: use e.g. {fits[0] if fits else 1}")
    if cfg.drafter.selector_top_k > vocab:
        raise ValueError(f"drafter.selector_top_k={cfg.drafter.selector_top_k} exceeds the target's "
                         f"vocabulary ({vocab}): use e.g. 16")
    rank = cfg.drafter.selector_rank
    need, have = 16 * rank * (2 * vocab + hidden), device_memory_bytes(device)
    if have and need > have:
        raise ValueError(f"drafter.selector_rank={rank}: the selector's codebooks and projection ({rank} x "
                         f"(2 x {vocab} + {hidden}) fp32 parameters) need {need / 1e9:,.1f} GB with their "
                         f"gradients and AdamW state, more than the {have / 1e9:,.1f} GB of this device: use "
                         "e.g. 256 (the released drafters')")


def device_memory_bytes(device) -> int:
    """The memory of ``device`` (a CUDA device's, else the machine's RAM); 0 when unknown."""
    try:
        if device is not None and torch.device(device).type == "cuda":
            return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return 0


def check_mask_token(dataset, mask_id: int, chunk: int = 1 << 26) -> int:
    """How often the drafter's mask id occurs in ``dataset``'s tokens (vectorised, ``chunk`` ids at
    a time over the memory map); warns naming the first sample when it does. A real token equal to
    the mask is indistinguishable from a masked slot to the drafter. A warning, not a refusal: a
    literal mask string in a few samples costs little, a wrong drafter.mask_token_id costs much."""
    ids = dataset.ids
    hits, first = 0, -1
    for start in range(0, len(ids), chunk):
        found = np.flatnonzero(np.asarray(ids[start:start + chunk]) == mask_id)
        if found.size and first < 0:
            first = start + int(found[0])
        hits += int(found.size)
    if hits:
        sample = max(0, int(np.searchsorted(dataset.starts, first, side="right")) - 1)
        log.warning("%s: drafter.mask_token_id=%d occurs %d times in the data (first in sample %d, source "
                    "row %d): the drafter cannot tell those tokens from its masks; set "
                    "drafter.mask_token_id to an id the data never holds (the tokenizer's <|MASK|>, or an "
                    "unused id)", dataset.path, mask_id, hits, sample,
                    int(dataset.source_index[sample]) if len(dataset.source_index) else -1)
    return hits


def check_tokenizer(target_dir: str, *datasets) -> None:
    """Data prepared with another tokenizer than the target's has ids that mean other tokens;
    it trains without error when they fit the vocabulary. `prepare` records its vocabulary's
    fingerprint; compared here with the target directory's tokenizer, where both exist."""
    from flashdraft.data.prepare import vocab_fingerprint

    fingerprint = None
    for dataset in datasets:
        wanted = (getattr(dataset, "meta", {}).get("source", {}).get("vocab_sha256")
                  if dataset is not None else None)
        if wanted is None:
            continue
        if fingerprint is None:
            try:
                fingerprint = vocab_fingerprint(target_tokenizer(str(target_dir)))
            except (OSError, ValueError) as exc:
                # a target directory without a tokenizer: nothing to compare
                log.warning("%s: cannot check that %s was prepared with the target's tokenizer (%s)",
                            target_dir, dataset.path, exc)
                return
        if fingerprint != wanted:
            prepared_with = dataset.meta["source"].get("tokenizer", "another tokenizer")
            raise ValueError(
                f"{dataset.path}: prepared with the tokenizer of {prepared_with}, whose vocabulary differs "
                f"from target.path's ({target_dir}): its token ids mean other tokens. Re-run flashdraft "
                f"prepare with --tokenizer {target_dir}"
            )


def drafter_rows(cfg: Config) -> DrafterRows:
    """The drafter's row budget of one micro-batch, as the run's config sets it (data.row_budget,
    objective.num_anchors, drafter.block_size): what the batch plan, the start-up checks and the memory
    plan all count."""
    return DrafterRows(cfg.data.row_budget, cfg.objective.num_anchors, cfg.drafter.block_size)


def check_lengths(dataset, cfg: Config, target_config) -> None:
    """Refuse samples no batch (or no target position) can hold: over the token budget, over the
    drafter's row budget, or past the target's positions."""
    if len(dataset) == 0:
        raise ValueError(
            f"{dataset.report.source}: no usable samples ({dataset.report.to_dict()}); check the data "
            f"(`flashdraft inspect {dataset.report.source}`) or lower data.min_supervised"
        )
    longest = int(dataset.lengths.max())
    if longest > cfg.data.token_budget:
        raise ValueError(
            f"{dataset.report.source}: data.token_budget={cfg.data.token_budget} is smaller than the longest "
            f"sample ({longest} tokens after truncation to data.max_length={cfg.data.max_length}); raise "
            f"data.token_budget to at least {longest} or lower data.max_length to {cfg.data.token_budget}"
        )
    check_row_budget(longest, drafter_rows(cfg), f"{dataset.report.source}: its longest sample")
    max_pos = getattr(target_config, "max_position_embeddings", None)
    if max_pos and longest > max_pos:
        raise ValueError(
            f"{dataset.report.source}: samples of up to {longest} tokens exceed the target's "
            f"max_position_embeddings={max_pos}; lower data.max_length to {max_pos} "
            "(longer samples are truncated)"
        )


def load_eval_prompts(cfg: Config, eval_dataset, target_config) -> list[list[int]]:
    """Held-out prompts for tau, read and checked at start-up (not at the first eval)."""
    from flashdraft.evaluate import check_prompts_fit, prompts_from_dataset, read_prompts  # loads transformers

    if cfg.eval.prompts_path:
        prompts = read_prompts(cfg.eval.prompts_path)[: cfg.eval.num_prompts]
    elif eval_dataset is not None:
        prompts = prompts_from_dataset(eval_dataset, cfg.eval.num_prompts)
    else:
        return []
    check_prompts_fit(prompts, target_config, cfg.eval.prompts_path or cfg.eval.data_path,
                      max_new_tokens=cfg.eval.max_new_tokens, block_size=cfg.drafter.block_size)
    return prompts
