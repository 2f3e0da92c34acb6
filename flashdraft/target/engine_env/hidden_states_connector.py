"""flashdraft's hidden-state connector for vLLM (runs inside the engine; vLLM imports it by module
name through ``kv_transfer_config["kv_connector_module_path"]``).

vLLM's ``extract_hidden_states`` speculative method stores, for every token it prefills, the
requested aux hidden states ``[n_aux, H]`` in a cache-only KV layer. Its
``ExampleHiddenStatesConnector`` keeps a finished request's blocks until it has copied the
request's rows out and written them, with the request's prompt token ids, to one safetensors file
(``hidden_states [T, n_aux, H]`` in the engine's dtype, ``token_ids [T]`` int64), whose path comes
back in the request's ``kv_transfer_params["hidden_states_path"]``. Its ``<path>.lock`` is held
exclusively from the step that first schedules the request until the file is complete.

``FlashdraftHiddenStates`` keeps that scheduler side (paths, locks, blocks held until copied) and
changes only where the copy runs:

- KV cache in host memory (vLLM's CPU build): the rows are gathered and written synchronously in
  the engine step that hands the request over, and the blocks are released in that same step. The
  stock write needs a CUDA stream, CUDA events and pinned memory, which a CPU build refuses.
- KV cache on a GPU: the stock path: the gather and a non-blocking copy into pinned host memory on
  a side stream, the file written by a thread once the copy's event has completed, the blocks
  released once the copy (not the write) is done.

Either way the lock is released only after the file is complete, so a reader that takes it
shared before reading (flashdraft.target.engine does) never sees a partial file.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands in for the stock path's copy event once a synchronous write has finished: the stock
    ``get_finished`` reports a request done (its blocks free) when its event says so."""

    @staticmethod
    def query() -> bool:
        return True


class FlashdraftHiddenStates(ExampleHiddenStatesConnector):
    """The stock connector, with a synchronous write where the KV cache is in host memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:  # one writer per engine: the first tensor-parallel rank
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # a gather: a new tensor
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            save_file({"hidden_states": rows, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the exclusive lock: the file is complete (or the write failed)
        self._req_copy_events[pending.req_id] = _Written
