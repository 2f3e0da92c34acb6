"""TokenDataset: a token shard opened by memory-mapping, with lengths known up front."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from flashdraft.data.shards import read_token_shard


class TokenDataset:
    """Zero-copy view of a token shard.

    ``lengths`` is an int64 array computed from the offsets alone; ``dataset[i]`` returns numpy
    views (ids, loss_mask) into the memory map, copying nothing.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.meta, self.ids, self.loss_mask, self.offsets = read_token_shard(self.path)
        self.lengths = np.diff(self.offsets)
        self.vocab_size = int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.offsets[i], self.offsets[i + 1]
        return self.ids[start:end], self.loss_mask[start:end]

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])
