"""The frozen target: loading it, its taps, and rewinding its KV cache when decoding.

- ``model``: ``TargetModel``, a Hugging Face causal LM loaded whole, heads-only or sharded,
  with the tap convention (tap i is ``hidden_states[i + 1]``) and the cached forward decoding uses.
- ``rewind``: each cache-layer kind's rollback after a verification, and the self-check
  (``check_rewind``) that refuses a rewind that is not exact before anything is decoded.
"""

from flashdraft.target.model import (
    TargetModel,
    default_target_layer_ids,
    resolve_dtype,
)
from flashdraft.target.rewind import (
    RewindError,
    UnsupportedCacheLayer,
    cache_length,
    check_rewind,
    crop_cache,
    mark_cache,
    rewind_cache,
)

__all__ = ["RewindError", "TargetModel", "UnsupportedCacheLayer", "cache_length",
           "check_rewind", "crop_cache", "default_target_layer_ids", "mark_cache", "resolve_dtype", "rewind_cache"]
