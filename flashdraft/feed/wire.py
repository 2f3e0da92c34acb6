"""The wire protocol of a disaggregated job's feature links: the message kinds, the step
header's layout, and the dtypes of what travels (flashdraft.feed.disaggregated runs it).

One link per (target rank, drafter rank), point-to-point on global ranks, each side's main
thread only, on two channels (flashdraft.distributed, docs/distributed.md)::

    control channel (gloo, host tensors; either direction):
    drafter -> target   HELLO: int64 [start step, total steps, drafter rank, drafter ranks, *cursor]
    target -> drafter   per step: a fixed-size int64 header (kind, signal, feature width and
                        dtype, the data cursor after the step, per micro-batch B, S, lengths,
                        sample ids); END (the answer to STOP) or ABORT + its utf-8 message
                        instead of a step
    drafter -> target   one control int64 [1]: DONE (every step received), STOP (stopped early,
                        e.g. SIGTERM: it drains the link until END) or ABORT (it failed)

    data channel (the device group, NCCL on CUDA; target -> drafter only):
    target -> drafter   per step, after its header: per micro-batch input_ids, loss_mask,
                        attention_mask, features

The data channel flows one way by construction: a target rank only sends on it, a drafter rank
only receives, and both post a step's tensors in the same order. Under NCCL a pair's ops run in
posting order on one stream, so the drafter's control message could not travel there: its
receive, posted ahead of the step's sends, would hold them back until the collective timeout.
"""

from __future__ import annotations

import numpy as np
import torch

from flashdraft.feed.steps import StepInput

DATA, END, ABORT = 1, 2, 3  # target -> drafter message kinds
DONE, STOP = 1, 2  # drafter -> target control (ABORT as above)

CURSOR_KEYS = ("epoch", "consumed", "step", "segment_start", "segment_world_size", "seed", "token_budget",
               "max_batch_size", "num_samples", "row_budget", "num_anchors",
               "block_size")  # BatchSampler.state_dict(), all ints
HELLO_SIZE = 4 + len(CURSOR_KEYS)
FEATURE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BATCH_DTYPES = {"input_ids": torch.int64, "loss_mask": torch.uint8, "attention_mask": torch.int64}


def hello(start_step: int, total_steps: int, rank: int, world_size: int, cursor: dict) -> torch.Tensor:
    """A drafter rank's HELLO: where its target rank starts, its plan (rank and world) and cursor."""
    return torch.tensor([start_step, total_steps, rank, world_size] + [int(cursor[k]) for k in CURSOR_KEYS])


def read_hello(msg: torch.Tensor) -> tuple[int, int, int, int, dict]:
    """(start step, total steps, drafter rank, drafter ranks, cursor) of a HELLO."""
    start, total, rank, world_size, *cursor = msg.tolist()
    return start, total, rank, world_size, dict(zip(CURSOR_KEYS, cursor))


class Header:
    """The fixed-size int64 header of a step message; both sides derive its size from the
    config (``grad_accum`` micro-batches of at most ``max_batch_size`` rows), so the receiver
    can post it before knowing anything else about the step."""

    FIXED = 4 + len(CURSOR_KEYS)  # kind, aux (ABORT: message bytes), feature width, dtype code, cursor

    def __init__(self, grad_accum: int, max_batch_size: int):
        self.grad_accum, self.max_rows = grad_accum, max_batch_size
        self.size = self.FIXED + grad_accum * (2 + 2 * max_batch_size)

    def micro_offset(self, j: int) -> int:
        """Where micro-batch j's fields start: B, S, lengths[max_rows], sample ids[max_rows]."""
        return self.FIXED + j * (2 + 2 * self.max_rows)

    def step(self, item: StepInput, signum: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(header, payload tensors in send order) of one step; host header, payload on device.
        ``signum``: a stop request the target rank received (SIGTERM / SIGINT), passed on in aux."""
        h = torch.zeros(self.size, dtype=torch.int64)
        features = item.micro[0].features
        h[:4] = torch.tensor([DATA, signum, features.shape[-1], FEATURE_DTYPES.index(features.dtype)])
        h[4 : self.FIXED] = torch.tensor([int(item.sampler_state[k]) for k in CURSOR_KEYS])
        payload = []
        for j, m in enumerate(item.micro):
            rows, seq = m.device_batch.input_ids.shape
            o = self.micro_offset(j)
            h[o : o + 2] = torch.tensor([rows, seq])
            h[o + 2 : o + 2 + rows] = m.batch.lengths  # host copies: the receiver needs no device sync for them
            h[o + 2 + self.max_rows : o + 2 + self.max_rows + rows] = torch.from_numpy(m.sample_ids)
            payload += [getattr(m.device_batch, name).contiguous() for name in BATCH_DTYPES] + [m.features.contiguous()]
        return h, payload

    def features(self, h: torch.Tensor) -> tuple[int, torch.dtype]:
        """The width and dtype of the features of the step whose header is ``h``."""
        return int(h[2]), FEATURE_DTYPES[int(h[3])]

    def micro_batches(self, h: torch.Tensor) -> list[tuple[int, int, torch.Tensor, np.ndarray]]:
        """(rows, padded length, lengths [rows], sample ids [rows]) of each micro-batch the header
        ``h`` announces, in send order (a last step of the plan may hold fewer than grad_accum)."""
        out = []
        for j in range(self.grad_accum):
            o = self.micro_offset(j)
            rows, seq = int(h[o]), int(h[o + 1])
            if rows:
                out.append((rows, seq, h[o + 2 : o + 2 + rows].clone(),
                            h[o + 2 + self.max_rows : o + 2 + self.max_rows + rows].numpy().copy()))
        return out

    def cursor(self, h: torch.Tensor) -> dict:
        """The data cursor after the step whose header is ``h``."""
        return {k: int(v) for k, v in zip(CURSOR_KEYS, h[4 : self.FIXED].tolist())}

    def control(self, kind: int, message: str = "") -> tuple[torch.Tensor, list[torch.Tensor]]:
        """An END or ABORT message (ABORT carries ``message``, utf-8)."""
        text = torch.frombuffer(bytearray(message.encode()[:4000] or b" "), dtype=torch.uint8)
        h = torch.zeros(self.size, dtype=torch.int64)
        h[:2] = torch.tensor([kind, len(text)])
        return h, [text] if kind == ABORT else []
