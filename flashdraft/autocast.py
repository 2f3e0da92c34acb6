"""Mixed precision around custom autograd Functions: ``autocast_suspended``, shared by the drafter's
training attention (flashdraft.drafter.attention), its layers' kernels (drafter.kernels) and the LM
head + CE of the loss (drafter.head_kernels).

Only torch is imported here, so any module may use it without pulling in the model code.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def autocast_suspended(device_type: str):
    """Yields the autocast dtype (None when autocast is off) and turns autocast off inside: for
    custom autograd Functions, whose backward runs outside autocast and whose ``out=`` matmuls
    autocast skips. The caller casts the inputs to the yielded dtype, as autocast would have."""
    if not torch.is_autocast_enabled(device_type):
        yield None
        return
    dtype = torch.get_autocast_dtype(device_type)
    with torch.autocast(device_type, enabled=False):
        yield dtype

