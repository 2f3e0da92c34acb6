"""The steps of benchmarks/gpu_multi.sh (2+ GPUs; SMOKE=1: CPU ranks with gloo)::

    python -m flashdraft.bench.multi_check job DIR              # a tiny saved target and data set
    torchrun ... -m flashdraft.bench.multi_check worker ARGS    # `flashdraft ARGS`, then this
                                                                # process's CUDA contexts -> $MULTI_CHECK_DIR
    python -m flashdraft.bench.multi_check contexts DIR         # each rank: a context on its own GPU only
    python -m flashdraft.bench.multi_check steps RUN N          # RUN's final checkpoint is step N
    python -m flashdraft.bench.multi_check same RUN_A RUN_B [RTOL]  # their final drafters are equal (to RTOL)

Each check prints one ``<what>: PASS`` / ``FAIL`` line and exits non-zero on FAIL. torch and
numpy are imported where a step needs them (``contexts`` reads JSON only: no 2 s torch import).

CUDA contexts are read in the process itself, from the driver (``cuDevicePrimaryCtxGetState``
per visible device), after the run: exact whatever the container's PID namespace (nvidia-smi's
per-process list shows host PIDs, or none, inside many containers).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

VOCAB, MASK_ID = 300, 299


def cuda_contexts() -> list[int]:
    """The visible CUDA devices (torch's indices) on which this process holds a primary
    context; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    count = ctypes.c_int()
    lib.cuDeviceGetCount(ctypes.byref(count))
    active = []
    for i in range(count.value):
        dev, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(dev), i)
        if lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(state)) != 0:
            raise RuntimeError(f"cuDevicePrimaryCtxGetState failed for device {i}")
        if state.value:
            active.append(i)
    return active


def make_job(root: Path) -> None:
    """A tiny Qwen3 target (saved) and a data set of 32 random 40-token samples."""
    import numpy as np

    from flashdraft.data.shards import write_token_shard
    from flashdraft.toy import tiny_causal_lm

    tiny_causal_lm(VOCAB, num_layers=4, hidden=64, seed=1, max_position_embeddings=512).save_pretrained(root / "target")
    rng = np.random.default_rng(0)
    mask = np.r_[np.zeros(6), np.ones(34)]
    write_token_shard(root / "data", [(rng.integers(0, MASK_ID, 40), mask) for _ in range(32)], vocab_size=VOCAB)


def worker(argv: list[str]) -> int:
    """`flashdraft ARGV` as the CLI runs it, then record this rank's CUDA contexts."""
    from flashdraft.cli import entry

    code = entry(argv)
    record = {"rank": int(os.environ.get("RANK", 0)), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
              "tag": os.environ.get("MULTI_CHECK_TAG", "run"), "pid": os.getpid(), "contexts": cuda_contexts(),
              "exit": code}
    directory = Path(os.environ.get("MULTI_CHECK_DIR", "."))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{record['tag']}-rank{record['rank']}.json").write_text(json.dumps(record))
    return code


def check_contexts(directory: Path) -> bool:
    """Every recorded process holds contexts on its own GPU (cuda:LOCAL_RANK) at most."""
    records = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    bad = [r for r in records if set(r["contexts"]) - {r["local_rank"]}]
    for r in bad:
        print(f"  {r['tag']} rank {r['rank']} (pid {r['pid']}, LOCAL_RANK {r['local_rank']}): contexts on GPUs "
              f"{r['contexts']}")
    ok = bool(records) and not bad
    print(f"CUDA contexts, {len(records)} processes, each on its own GPU only: {'PASS' if ok else 'FAIL'}")
    return ok


def _final(run: Path):
    from flashdraft.checkpoint import CheckpointManager

    loaded = CheckpointManager(run / "checkpoints").load_latest()
    return (loaded.step, loaded.parts["drafter"]) if loaded is not None else (None, {})


def check_steps(run: Path, steps: int) -> bool:
    step, _ = _final(run)
    ok = step == steps
    print(f"{run.name}: final checkpoint at step {step}, expected {steps}: {'PASS' if ok else 'FAIL'}")
    return ok


def check_same(a: Path, b: Path, rtol: float = 0.0) -> bool:
    """Run ``b`` (resumed) ends with the drafter of run ``a``: bitwise (``rtol`` 0: deterministic
    CPU kernels), else within ``rtol`` (GPU atomics reorder sums)."""
    import torch

    (step_a, wa), (step_b, wb) = _final(a), _final(b)
    diff = max((float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if k in wb), default=float("inf"))
    ok = step_a == step_b and wa.keys() == wb.keys() and all(
        torch.allclose(wa[k].float(), wb[k].float(), rtol=rtol, atol=rtol / 10) for k in wa)
    print(f"{b.name} (resumed) vs {a.name} (uninterrupted), step {step_b} vs {step_a}: max |diff| {diff:.3g}, "
          f"bitwise {'equal' if ok and diff == 0 else 'different'}: {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str]) -> int:
    what, args = argv[0], argv[1:]
    if what == "job":
        make_job(Path(args[0]))
        return 0
    if what == "worker":
        return worker(args)
    checks = {"contexts": lambda: check_contexts(Path(args[0])),
              "steps": lambda: check_steps(Path(args[0]), int(args[1])),
              "same": lambda: check_same(Path(args[0]), Path(args[1]), float(args[2]) if len(args) > 2 else 0.0)}
    if what not in checks:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if checks[what]() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
