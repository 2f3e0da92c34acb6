"""Collate: gather a batch's samples straight from the memory map into preallocated buffers.

``pad_batch`` copies each sample's ids / loss_mask slice from the memmap into one flat
buffer per field (pinned when CUDA is present), viewed as [B, S] with S the batch's longest
sample. No Python list, no per-sample tensor, no ``.tolist()`` of token data.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass
class Batch:
    """One padded micro-batch (right padding).

    input_ids      [B, S] int64, pad_id after each sample's end
    loss_mask      [B, S] uint8, 1 = supervised; 0 on padding
    attention_mask [B, S] int64, 1 = real token, 0 = padding
    lengths        [B] int64, real tokens per row (S = lengths.max())
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor

    def to(self, device, non_blocking: bool = True) -> Batch:
        """Copy to ``device``; asynchronous when the source is pinned and non_blocking is set.

        The copy reads the source buffers after this call returns: do not refill them (another
        ``pad_batch`` with the same CollateBuffers) until the copy is known done, e.g. via an
        event recorded on the copying stream.
        """
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)


class CollateBuffers:
    """Reusable flat buffers, one per field; they grow to the largest batch seen, then stay.

    Batches returned by ``pad_batch(..., buffers=this)`` are VIEWS of these buffers and are
    overwritten by the next call with the same object; a pipeline keeps a small ring of them
    (one per batch in flight).
    """

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.capacity_tokens = 0
        self.capacity_rows = 0
        self._alloc_tokens(0)
        self._alloc_rows(0)

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pin_memory)

    def _alloc_tokens(self, n: int) -> None:
        self.ids_t, self.mask_t, self.attn_t = (self._empty(n, d) for d in (torch.int64, torch.uint8, torch.int64))
        self.ids_np, self.mask_np, self.attn_np = self.ids_t.numpy(), self.mask_t.numpy(), self.attn_t.numpy()
        self.capacity_tokens = n

    def _alloc_rows(self, n: int) -> None:
        self.len_t = self._empty(n, torch.int64)
        self.len_np = self.len_t.numpy()
        self.capacity_rows = n

    def reserve(self, rows: int, tokens: int) -> None:
        """Make room for a [rows, tokens // rows] batch (growing by at least 1.5x to avoid churn)."""
        if tokens > self.capacity_tokens:
            self._alloc_tokens(max(tokens, int(self.capacity_tokens * 1.5)))
        if rows > self.capacity_rows:
            self._alloc_rows(max(rows, int(self.capacity_rows * 1.5)))


def pad_batch(dataset, indices, *, buffers: CollateBuffers | None = None, pad_id: int = 0,
              pin_memory: bool | None = None) -> Batch:
    """Pad the samples ``dataset[indices]`` into a Batch (see Batch for shapes and dtypes).

    dataset: a TokenDataset (uses its ``ids`` / ``loss_mask`` memmaps, ``starts`` and ``lengths``).
    buffers: reuse these (steady state allocates nothing); None: fresh buffers for this call.
    pin_memory: for fresh buffers only; None = pin when CUDA is available.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if indices.ndim != 1 or len(indices) == 0:
        raise ValueError(f"pad_batch needs a non-empty 1-D array of sample indices, got shape {indices.shape}")
    if buffers is None:
        buffers = CollateBuffers(pin_memory=pin_memory)
    lengths = dataset.lengths[indices]
    starts = dataset.starts[indices]
    b, s = len(indices), int(lengths.max())
    buffers.reserve(b, b * s)
    ids = buffers.ids_np[: b * s].reshape(b, s)
    mask = buffers.mask_np[: b * s].reshape(b, s)
    attn = buffers.attn_np[: b * s].reshape(b, s)
    src_ids, src_mask = dataset.ids, dataset.loss_mask
    # Fill the whole [B, S] block once, then one slice copy per sample and field: B is at most
    # max_batch_size, the copies run at memcpy speed (widening uint16/uint32 -> int64 on the
    # way), and no batch-sized temporary is made (a fancy-index gather makes three, and measured
    # slower). The sources are plain ndarray views of the memmap: slicing np.memmap objects
    # costs microseconds each in __array_finalize__.
    ids.fill(pad_id)
    mask.fill(0)
    for row, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        ids[row, :n] = src_ids[start : start + n]
        mask[row, :n] = src_mask[start : start + n]
    np.less(np.arange(s)[None, :], lengths[:, None], out=attn, casting="unsafe")
    vocab = getattr(dataset, "vocab_size", None)
    if vocab is not None and b * s and int(ids.max()) >= vocab:
        # open_dataset checks ids against meta.json's max_id; this per-batch max (B x S values,
        # no sync) catches a shard whose metadata lies, before the id reaches an embedding.
        row = int(np.argmax(ids.max(1)))
        source = getattr(dataset, "source_index", indices)[indices[row]]
        raise ValueError(
            f"{getattr(dataset, 'path', 'dataset')}: sample {int(source)} has token id {int(ids[row].max())} >= "
            f"vocab_size {vocab}, although the shard's meta.json max_id says otherwise: the shard is corrupt; "
            "re-run `flashdraft prepare` (or re-convert the source)"
        )
    buffers.len_np[:b] = lengths
    return Batch(
        input_ids=buffers.ids_t[: b * s].view(b, s),
        loss_mask=buffers.mask_t[: b * s].view(b, s),
        attention_mask=buffers.attn_t[: b * s].view(b, s),
        lengths=buffers.len_t[:b],
    )
