"""The DFlash drafter: the block-diffusion drafter model, its training attention, and its
serving-format save / load.

Modules: ``model`` (DFlashDrafter, its layers, ContextCache), ``attention`` (the training-attention
implementations and their choice; imports no transformers), ``kernels`` (custom-backward RMSNorm /
RoPE / SwiGLU, the rotary embedding), ``head_kernels`` (the loss's LM head + CE; torch only) and
``serving`` (config.json and the export files).

The public names below are imported lazily (PEP 562), on first access: importing one submodule,
e.g. ``flashdraft.drafter.attention`` from the config, loads only that submodule and what it
imports, not the model (and transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the submodule that defines it
_EXPORTS = {
    "DFlashDrafter": "model",
    "ContextCache": "model",
    "drafter_config_from_target": "serving",
    "ATTENTION_IMPLS": "attention",
    "resolve_attention": "attention",
}

__all__ = ["DFlashDrafter", "ContextCache", "drafter_config_from_target", "ATTENTION_IMPLS", "resolve_attention"]

if TYPE_CHECKING:
    from flashdraft.drafter.attention import ATTENTION_IMPLS, resolve_attention
    from flashdraft.drafter.model import ContextCache, DFlashDrafter
    from flashdraft.drafter.serving import drafter_config_from_target


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
