"""The one-GPU check's parts (benchmarks/gpu_checks.sh), one function each, and the tools they share.

Each part returns a JSON-able dict with ``ok`` (its assertions held) and its figures; the script
runs every part in its own process under its own time limit and writes the part's JSON as soon as
the part ends, so a timeout loses only that part. ``--smoke`` runs every part's code path on CPU at
toy sizes (tests/test_gpu_scripts.py).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of tensor storage alive at once among the tensors that ops create inside
    the mode (``peak``), on any device: each op's outputs counted once per storage until the
    last of their Python tensors referring to it is gone. Tensors made before the mode are the
    baseline, not counted. For no-grad code: a storage autograd keeps alive after its Python
    tensors die is not seen."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, Python tensors referring]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]
