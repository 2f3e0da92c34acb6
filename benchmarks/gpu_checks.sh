#!/usr/bin/env bash
# Every GPU check of this project in one run, for the one device session a task may get
# (<= 9.8 minutes on one H200: the parts' time limits add up to 590 s). Each part has its own time limit, so a part that fails or hangs
# does not eat the others' time. Everything lands in $OUT (default ./gpu_results):
#   env.txt                      torch, CUDA and the device
#   gpu_step.txt / .json         the drafter step at the Qwen3-8B point: ms, peak memory,
#                                achieved TFLOP/s of needed work and its share of peak (is the
#                                fast step compute-bound on a GPU?)
#   gpu_pipeline.txt / .json     the trainer sequential vs pipelined: tokens/s, GPU busy share,
#                                stage split, loss agreement (does the pipeline keep the GPU busy,
#                                without changing the results?)
#   gpu_swa.txt / .json          the same drafter step with every layer sliding-window 1024 and
#                                D-PACE weights, fast path: the compiled flex kernel under a window
#                                mask (a GPU-only code path) and its cost next to gpu_step; and the
#                                DFlash2 step (conv + selector) at the same point, the released
#                                DFlash2 drafters' layout: the cost of DFlash2's modules
#   gpu_sharded.txt              a tensor-parallel target on 2 GPUs (NCCL, DTensor) against the
#                                same eval unsharded; skipped on a 1-GPU machine
# Then copy the numbers into docs/benchmarks.md.
#
#   bash benchmarks/gpu_checks.sh            # on the GPU machine
#   SMOKE=1 bash benchmarks/gpu_checks.sh    # the same on CPU at toy sizes, in seconds
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-gpu_results} PYTHONPATH=$PWD
mkdir -p "$OUT"
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1 | tee "$OUT/env.txt"
if [ "${SMOKE:-0}" = 1 ]; then  # the benchmarks' own flags, then CPU / toy overrides
  step_args=(--device cpu --dtype float32 --seq 64 --anchors 4 --hidden 128 --head-dim 64 --intermediate 256
             --layers 1 --taps 2 --vocab 512 --chunk 16 --repeat 1)
  pipeline_args=(--smoke)
else
  step_args=()
  pipeline_args=()
fi
status=0
timeout "${STEP_TIMEOUT:-200}" bash benchmarks/gpu_step.sh --json "$OUT/gpu_step.json" "${step_args[@]}" 2>&1 \
  | tee "$OUT/gpu_step.txt" || status=1
timeout "${PIPELINE_TIMEOUT:-190}" python -m flashdraft.cli bench gpu-pipeline "${pipeline_args[@]}" 2>&1 \
  | tee "$OUT/gpu_pipeline.txt" || status=1
timeout "${SWA_TIMEOUT:-120}" bash benchmarks/gpu_step.sh --json "$OUT/gpu_swa.json" --variants fast,dflash2 \
  --sliding-window 1024 --weighting dpace --repeat 3 "${step_args[@]}" 2>&1 | tee "$OUT/gpu_swa.txt" || status=1
timeout "${SHARDED_TIMEOUT:-80}" bash benchmarks/gpu_sharded.sh 2>&1 | tee "$OUT/gpu_sharded.txt" || status=1
exit $status
