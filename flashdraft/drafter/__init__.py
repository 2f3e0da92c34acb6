"""The DFlash drafter: the block-diffusion drafter model, its training attention, and its
serving-format save / load.

Modules: ``model`` (DFlashDrafter, its layers, ContextCache), ``attention`` (the training-attention
implementations and their choice), ``dflash2`` (DFlash2's conv and candidate selector), ``kernels``
(custom-backward RMSNorm / RoPE / SwiGLU, the rotary embedding), ``head_kernels`` (the loss's LM
head + CE; torch only) and ``serving`` (config.json and
the export files). The choice lists and each layer's pattern (``LayerMask``) are the config's
(``flashdraft.config``), so nothing outside the drafter imports this package only for them.
"""

from flashdraft.drafter import stand_in  # noqa: F401 - registers the memory plan's stand-in attention
from flashdraft.drafter.attention import resolve_attention
from flashdraft.drafter.model import ContextCache, DFlashDrafter
from flashdraft.drafter.serving import drafter_config_from_target

__all__ = ["DFlashDrafter", "ContextCache", "drafter_config_from_target", "resolve_attention"]
