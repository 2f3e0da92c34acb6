"""The drafter's serving format: its config.json and the files of an export.

What a DFlash serving stack (vLLM, SGLang, transformers' remote code) reads: config.json, the
target's Qwen3 fields (``drafter_config_from_target``) plus the DFlash keys, and model.safetensors,
the drafter's own weights (no embedding, no LM head, no rotary buffers). Here: building that
config from the target's, translating it into the Qwen3Config the layers are built from
(``qwen3_config``), refusing configs whose layers this package does not implement
(``check_supported``), and writing / reading an export's files. Nothing here needs the model
classes; DFlashDrafter.save_pretrained / from_pretrained delegate their file work to this module.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from flashdraft.checkpoint import follow_umask

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Target config fields copied into the drafter's config.json (faithfully: a RoPE mismatch
# silently destroys acceptance at serving time).
_COPIED_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "attention_bias", "attention_dropout", "rope_theta", "rope_scaling",
    "rope_parameters", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range",
)
# RoPE settings of a hybrid target's OWN attention that the drafter (plain Qwen3 attention: every
# head dim rotated, 1-D positions) does not use. Copied, they would make the config say one thing
# and training do another: vLLM and SGLang read partial_rotary_factor (Qwen3-Next / Qwen3.5: 0.25)
# and would rotate a quarter of each head, while transformers' Qwen3 rotary, which the drafter
# trains with, rotates all of it.
_TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def drafter_config_from_target(
    target_config, *, num_layers: int, block_size: int, mask_token_id: int, target_layer_ids: list[int]
) -> dict:
    """The drafter's config.json as a dict: the target's Qwen3 fields + the DFlash keys."""
    src = target_config.to_dict()
    cfg = {key: src[key] for key in _COPIED_FIELDS if key in src}
    cfg.setdefault("head_dim", src["hidden_size"] // src["num_attention_heads"])
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict):
            cfg[key] = {k: v for k, v in cfg[key].items() if k not in _TARGET_ONLY_ROPE_KEYS}
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # older loaders read the top-level field
    if "rope_scaling" not in cfg and rope.get("rope_type", "default") != "default":
        # ... and their scaling (YaRN, linear, llama3) from rope_scaling, in its legacy form
        cfg["rope_scaling"] = {"type": rope["rope_type"], **{k: v for k, v in rope.items() if k != "rope_theta"}}
    cfg.setdefault("attention_bias", False)
    cfg.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=num_layers,
        num_target_layers=int(src["num_hidden_layers"]),
        block_size=block_size,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids)},
        layer_types=["full_attention"] * num_layers,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    if not 0 <= mask_token_id < cfg["vocab_size"]:
        raise ValueError(
            f"model.mask_token_id={mask_token_id} is outside the target's embedding table (vocab_size "
            f"{cfg['vocab_size']}): set model.mask_token_id to an unused id in [0, {cfg['vocab_size'] - 1}] "
            "(Qwen3: 151669), or add a mask token to the tokenizer and resize the target's embeddings"
        )
    return cfg


def qwen3_config(cfg: dict) -> Qwen3Config:
    """The Qwen3Config the drafter's layers are built from, out of its serving config dict ``cfg``
    (the copied target fields and the layer count; ``cfg`` itself is left unchanged)."""
    keys = set(_COPIED_FIELDS) | {"num_hidden_layers", "layer_types"}
    # deep copies: Qwen3Config standardises rope dicts in place, which would change what we save
    return Qwen3Config(**{k: copy.deepcopy(v) for k, v in cfg.items() if k in keys and v is not None})


# Config keys of newer DFlash checkpoints whose behaviour this drafter does not implement: a
# drafter loaded while ignoring them would draft unlike the one that was trained (wrong tau).
_UNSUPPORTED_KEYS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")


def check_supported(config: dict, where) -> None:
    """Refuse, with the reason, a drafter config whose layers differ from the full-attention
    Qwen3 layers implemented here (sliding-window layers, scaled embeddings or outputs)."""
    kinds = set(config.get("layer_types") or ["full_attention"])
    problems = []
    if kinds != {"full_attention"}:
        problems.append(f"layer_types {sorted(kinds)} (only full_attention layers are implemented)")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        problems.append(f"use_sliding_window with sliding_window={config['sliding_window']}")
    problems += [f"{key}={config[key]!r}" for key in _UNSUPPORTED_KEYS if config.get(key) not in (None, 1, 1.0)]
    if problems:
        raise ValueError(f"{where}: this DFlash drafter uses {'; '.join(problems)}, which flashdraft does not "
                         "implement; evaluating or fine-tuning it here would give a different drafter")



def write_export(path: str | os.PathLike, state: dict[str, torch.Tensor], config: dict) -> Path:
    """Write ``config`` as config.json and ``state`` (CPU tensors, contiguous) as model.safetensors
    into the directory ``path``, created if missing; returns it as a Path. Each file is written
    beside its final name and renamed onto it: a crash mid-export leaves the previous export's
    file, never a torn one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = {name: path / f".{name}.tmp-{os.getpid()}" for name in (WEIGHTS_FILE, CONFIG_FILE)}
    try:
        save_file(state, tmp[WEIGHTS_FILE], metadata={"format": "pt"})
        follow_umask(tmp[WEIGHTS_FILE])
        tmp[CONFIG_FILE].write_text(json.dumps(config, indent=2) + "\n")
        for name, written in tmp.items():
            os.replace(written, path / name)
    finally:
        for written in tmp.values():
            written.unlink(missing_ok=True)
    return path


def read_config(path: str | os.PathLike) -> dict:
    """The config.json of the export in the directory ``path``; ValueError unless it is a DFlash
    drafter whose layers this package implements (check_supported)."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    if "DFlashDraftModel" not in config.get("architectures", []):
        raise ValueError(f"{path}/config.json: not a DFlash drafter (architectures={config.get('architectures')})")
    check_supported(config, path / CONFIG_FILE)
    return config


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of the export in the directory ``path`` (model.safetensors), on CPU in the
    dtype they were saved in."""
    return load_file(Path(path) / WEIGHTS_FILE)
