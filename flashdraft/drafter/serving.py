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
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from flashdraft.checkpoint import follow_umask
from flashdraft.config import LAYER_TYPES, LayerMask, blind_slots, check_model_sizes, smallest_sighted_window
from flashdraft.drafter.dflash2 import DFlash2Modules

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


DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


def dflash2_modules(config: dict) -> DFlash2Modules | None:
    """The DFlash2 sizes of a drafter ``config`` (None: a DFlash drafter), each read from
    ``dflash_config`` with the top-level key as fallback (the reference's rule)."""
    if DFLASH2_ARCHITECTURE not in (config.get("architectures") or []):
        return None
    dflash = config.get("dflash_config") or {}
    values = {f.name: dflash.get(f.name, config.get(f.name)) for f in dataclasses.fields(DFlash2Modules)}
    missing = [name for name, value in values.items() if not isinstance(value, int) or isinstance(value, bool)]
    if missing:
        raise ValueError(f"a DFlash2 drafter needs the integers {', '.join(f'dflash_config.{n}' for n in missing)} "
                         f"(vLLM requires all four); got {', '.join(f'{n}={values[n]!r}' for n in missing)}")
    return DFlash2Modules(**values)


def drafter_config_of(section, target_config, target_layer_ids, mask_token_id: int) -> dict:
    """The drafter's config.json for a run's ``drafter`` config section (config.DrafterConfig),
    tapping ``target_layer_ids`` of the target whose config is ``target_config``: the one path from
    a run's config to its drafter, which the trainer's drafter, the memory plan's and the
    quickstart's all take (drafter_config_from_target for the fields)."""
    return drafter_config_from_target(
        target_config, num_layers=section.num_layers, block_size=section.block_size, mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids), layer_types=section.per_layer_types,
        sliding_window=section.sliding_window, causal=section.causal, dflash2=DFlash2Modules.of(section),
        sinks=section.attention_sink)


def drafter_config_from_target(
    target_config, *, num_layers: int, block_size: int, mask_token_id: int, target_layer_ids: list[int],
    layer_types: list[str] | tuple[str, ...] | None = None, sliding_window: int | None = None,
    causal: bool | None = None, dflash2: DFlash2Modules | None = None, sinks: bool = False,
) -> dict:
    """The drafter's config.json as a dict: the target's Qwen3 fields + the DFlash keys.

    ``layer_types``: one of LAYER_TYPES per layer (None: all full, DFlash v1), ``sliding_window``
    the window of the sliding layers (HF convention: the query counts), ``causal`` in-block
    causality for every layer (None: by layer type, sliding causal and full bidirectional). The
    attention keys are written as every engine reads them (layer_attention; DFLASH2.md 3.3):
    an explicit ``layer_types`` list, ``sliding_window`` with ``use_sliding_window`` and
    ``max_window_layers``, and ``is_causal`` (with ``dflash_config.causal``) whenever all layers
    share one causality (a mixed model keeps the by-type default, which both engines apply).
    ``dflash2``: a DFlash2DraftModel with these conv / selector sizes in ``dflash_config``
    (with ``block_size``: SGLang reads it there first). ``sinks``: an attention sink in every layer
    (``dflash_config.attention_sink_bias`` and the top-level ``attention_sink_bias``, as ModelOpt
    writes them; vLLM and SGLang read the former)."""
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
    types = list(layer_types) if layer_types else ["full_attention"] * num_layers
    sliding = "sliding_attention" in types
    cfg.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=num_layers,
        num_target_layers=int(src["num_hidden_layers"]),
        block_size=block_size,
        dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids)},
        layer_types=types,
        use_sliding_window=sliding,
        sliding_window=int(sliding_window) if sliding else None,
        max_window_layers=num_layers,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    resolved = [layer.causal for layer in layer_attention(cfg if causal is None else {**cfg, "is_causal": causal})]
    if len(set(resolved)) == 1:
        cfg["is_causal"] = cfg["dflash_config"]["causal"] = resolved[0]
    if sliding:
        cfg["dflash_config"]["swa_window_size"] = int(sliding_window)
    if sinks:
        cfg["attention_sink_bias"] = cfg["dflash_config"]["attention_sink_bias"] = True
    if dflash2 is not None:
        cfg["architectures"] = [DFLASH2_ARCHITECTURE]
        cfg["dflash_config"].update(block_size=block_size, **dataclasses.asdict(dflash2))
    if not 0 <= mask_token_id < cfg["vocab_size"]:
        raise ValueError(
            f"drafter.mask_token_id={mask_token_id} is outside the target's embedding table (vocab_size "
            f"{cfg['vocab_size']}): set drafter.mask_token_id to an unused id in [0, {cfg['vocab_size'] - 1}] "
            "(Qwen3: 151669), or add a mask token to the tokenizer and resize the target's embeddings"
        )
    return cfg


def qwen3_config(cfg: dict) -> Qwen3Config:
    """The Qwen3Config the drafter's layers are built from, out of its serving config dict ``cfg``
    (the copied target fields and the layer count; ``cfg`` itself is left unchanged)."""
    keys = set(_COPIED_FIELDS) | {"num_hidden_layers", "layer_types"}
    # deep copies: Qwen3Config standardises rope dicts in place, which would change what we save
    return Qwen3Config(**{k: copy.deepcopy(v) for k, v in cfg.items() if k in keys and v is not None})


def layer_attention(config: dict) -> list:
    """Each layer's attention pattern (config.LayerMask) as the serving engines resolve it
    from ``config`` (vLLM ``_resolve_layer_attention`` / ``_dflash_layer_causal``, SGLang,
    the reference; DFLASH2.md 3.1-3.2): the type from ``layer_types`` (without it, as HF's
    Qwen3Config derives it from ``use_sliding_window`` / ``max_window_layers``; all sliding when
    none is and ``dflash_config.use_swa`` is set); a sliding layer's window from
    ``dflash_config.swa_window_size``, else ``sliding_window``; in-block causality from
    ``is_causal``, else ``dflash_config.causal``, else causal exactly for the layers
    ``layer_types`` lists as sliding."""
    dflash = config.get("dflash_config") or {}
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if not types:  # HF Qwen3Config's derivation: sliding from layer max_window_layers on, when enabled
        first = config.get("max_window_layers", 28)  # Qwen3Config's default
        sliding = bool(config.get("use_sliding_window") and config.get("sliding_window"))
        types = ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}: give one per layer")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown}: flashdraft implements {', '.join(LAYER_TYPES)}")
    by_type = [t == "sliding_attention" for t in types]  # the default causality: the listed type's
    if dflash.get("use_swa") and not any(by_type):
        types = ["sliding_attention"] * n  # forced sliding, still bidirectional by default (vLLM; MiMo)
    window = dflash.get("swa_window_size") or config.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"sliding_attention layers need a window: sliding_window={window!r}; set a positive "
                         "integer (HF convention: the query position counts)")
    explicit = config.get("is_causal")
    if explicit is None:
        explicit = dflash.get("causal")
    return [LayerMask(window if t == "sliding_attention" else None, bool(explicit) if explicit is not None else c)
            for t, c in zip(types, by_type)]


def check_sight(config: dict) -> None:
    """ValueError when some scored slot of the block could see no context row, so none of the
    target's features, in any layer (config.blind_slots): a sliding window too small for the
    block and the number of layers, with no full layer."""
    block_size = (config.get("dflash_config") or {}).get("block_size") or config.get("block_size")  # as model.py
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ValueError(f"block_size={block_size!r}: give the drafter's block size (2 or more) in "
                         "dflash_config.block_size or block_size")
    layers = layer_attention(config)
    blind = blind_slots(layers, block_size)
    if blind:
        raise ValueError(f"sliding_window={layers[0].window} with block_size {block_size} and {len(layers)} sliding "
                         f"layer(s) leaves block slots {blind[0]}..{blind[-1]} without any target feature; a drafter "
                         f"needs a window of {smallest_sighted_window(layers, block_size)} or more, or a full layer")


def attention_sinks(config: dict) -> bool:
    """Whether the drafter's layers have attention sinks, as the engines read it:
    ``dflash_config.attention_sink_bias`` (vLLM, SGLang) or the top-level
    ``add_swa_attention_sink_bias`` (vLLM builds the sink for every layer when either is true).
    The top-level ``attention_sink_bias`` ModelOpt also writes is not read by them, so not here.
    ValueError for a value that is not a bool (SGLang refuses it)."""
    dflash = config.get("dflash_config") or {}
    values = [dflash.get("attention_sink_bias"), config.get("add_swa_attention_sink_bias")]
    if any(v is not None and not isinstance(v, bool) for v in values):
        raise ValueError(f"attention_sink_bias / add_swa_attention_sink_bias must be true or false, not {values}")
    return any(values)


# Config keys of newer DFlash checkpoints whose behaviour this drafter does not implement: a
# drafter loaded while ignoring them would draft unlike the one that was trained (wrong tau).
_UNSUPPORTED_KEYS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")


def check_supported(config: dict, where) -> None:
    """Refuse, with the reason, a drafter config whose layers differ from the Qwen3 layers
    implemented here (full and sliding-window attention, in-block causal or not, attention sinks,
    DFlash2's conv and selector): scaled embeddings, values or outputs, unknown layer types, a
    DFlash2 config without its module sizes."""
    check_model_sizes(config, str(where))  # bounded before anything is built from them (a tampered size: one line)
    problems = []
    for check in (layer_attention, check_sight, dflash2_modules, attention_sinks):
        if check is check_sight and problems:
            continue  # the layers themselves are wrong: said once, above
        try:
            check(config)
        except (ValueError, KeyError) as exc:
            problems.append(str(exc))
    dflash = config.get("dflash_config") or {}
    mask, vocab = dflash.get("mask_token_id"), config.get("vocab_size")
    if not (isinstance(mask, int) and isinstance(vocab, int) and 0 <= mask < vocab):
        problems.append(f"dflash_config.mask_token_id={mask!r} is no id of its vocabulary (vocab_size={vocab!r})")
    # each where the engines read it: dflash_config first (DFlash2's reference), then the top level
    for key in ("attention_value_scale", *_UNSUPPORTED_KEYS):  # + MiMo's value scale (SGLang)
        value = dflash.get(key, config.get(key))
        if value not in (None, 1, 1.0):
            problems.append(f"{key}={value!r}")
    if problems:
        # each problem a whole sentence of its own, after the verdict (not spliced into one clause)
        raise ValueError(f"{where}: this DFlash drafter uses what flashdraft does not implement, so evaluating or "
                         "fine-tuning it here would give a different drafter. "
                         + " ".join(p.rstrip(".") + "." for p in problems))



def config_fields(config: dict) -> dict[str, dict]:
    """The run config's fields, by section (target, drafter), that describe the drafter of the
    export whose config.json is ``config`` (the inverse of ``drafter_config_from_target``): its
    taps, layers, block, MASK id, attention per layer, sinks and family (with DFlash2's sizes). A
    run that starts from the export (drafter.init_from) takes its drafter's shape from these, not
    from its own config."""
    layers = layer_attention(config)
    dflash = config.get("dflash_config") or {}
    sliding = [layer.window is not None for layer in layers]
    by_type = [layer.causal == s for layer, s in zip(layers, sliding)]  # the default: sliding causal, full not
    causal = {layer.causal for layer in layers}
    if not all(by_type) and len(causal) > 1:
        raise ValueError("its layers mix in-block causality in a way drafter.causal cannot say (one value for "
                         "all layers, or by layer type); flashdraft cannot continue training it")
    taps = {"layer_ids": tuple(int(i) for i in dflash["target_layer_ids"]), "num_taps": len(dflash["target_layer_ids"])}
    fields = {
        "num_layers": len(layers),
        "block_size": int(dflash.get("block_size") or config["block_size"]),
        "mask_token_id": int(dflash["mask_token_id"]),
        "layer_types": tuple("sliding_attention" if s else "full_attention" for s in sliding) if any(sliding)
        else (),
        "sliding_window": next((layer.window for layer in layers if layer.window is not None), None),
        "causal": None if all(by_type) else causal.pop(),
        "attention_sink": attention_sinks(config),
        "family": "dflash",
    }
    dflash2 = dflash2_modules(config)
    if dflash2 is not None:
        fields.update(family="dflash2", **dataclasses.asdict(dflash2))
    return {"target": taps, "drafter": fields}


def write_export(path: str | os.PathLike, state: dict[str, torch.Tensor], config: dict) -> Path:
    """Write ``config`` as config.json and ``state`` (CPU tensors, contiguous) as model.safetensors
    into the directory ``path``, created if missing; returns it as a Path. Each file is written
    beside its final name and renamed onto it: a crash mid-export leaves the previous export's
    file, never a torn one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = {}
    for name in (WEIGHTS_FILE, CONFIG_FILE):  # new files (mkstemp): no predictable name to plant a link at
        fd, tmp[name] = tempfile.mkstemp(dir=path, prefix=f".{name}.")
        os.close(fd)
        tmp[name] = Path(tmp[name])
    try:
        save_file(state, tmp[WEIGHTS_FILE], metadata={"format": "pt"})
        follow_umask(tmp[WEIGHTS_FILE])
        tmp[CONFIG_FILE].write_text(json.dumps(config, indent=2) + "\n")
        follow_umask(tmp[CONFIG_FILE])  # mkstemp made it 0600
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
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path / CONFIG_FILE}: cannot read the drafter's config ({exc}); give a drafter export "
                         "directory (flashdraft export writes one)") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG_FILE}: not a JSON object; give a drafter export directory")
    architectures = config.get("architectures") or []
    if not {"DFlashDraftModel", DFLASH2_ARCHITECTURE} & set(architectures):
        raise ValueError(f"{path}/config.json: not a DFlash or DFlash2 drafter (architectures={architectures})")
    check_supported(config, path / CONFIG_FILE)
    return config


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the export's model.safetensors, from its header (no data read)."""
    try:
        with safe_open(Path(path) / WEIGHTS_FILE, framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # safetensors' own errors name no file
        raise ValueError(f"{Path(path) / WEIGHTS_FILE}: cannot read the drafter's weights ({exc}); the export is "
                         "damaged: export it again (flashdraft export)") from None


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of the export in the directory ``path`` (model.safetensors), on CPU in the
    dtype they were saved in."""
    try:
        return load_file(Path(path) / WEIGHTS_FILE)
    except Exception as exc:  # safetensors' own errors name no file
        raise ValueError(f"{Path(path) / WEIGHTS_FILE}: cannot read the drafter's weights ({exc}); the export is "
                         "damaged: export it again (flashdraft export)") from None
