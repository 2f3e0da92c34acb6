#!/usr/bin/env bash
# Drafter step on one GPU for a Qwen3-8B-sized drafter (hidden 4096, 32 q / 8 kv heads of 128,
# MLP 12288, 5 layers, 5 taps, vocab 151936), bf16, seq 3072, 512 anchors x block 16.
# Prints ms_per_step, peak memory and the achieved TFLOP/s of needed work with its share of
# peak (H100/H200 SXM dense bf16: 989 TFLOP/s; pass another PEAK for other parts).
# The fast path uses flex_attention (compiled) on CUDA; the reference (dense mask) is run too
# and may run out of memory -- then it is reported as such, not raised. Pass --autocast to run
# as the trainer does (fp32 drafter under bf16 autocast; the lean RMSNorm / RoPE / SwiGLU step aside).
set -euo pipefail
PEAK=${PEAK:-989}
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD python -m flashdraft.cli bench step --device cuda --dtype bfloat16 \
  --seq 3072 --anchors 512 --block 16 --hidden 4096 --head-dim 128 --intermediate 12288 \
  --layers 5 --taps 5 --vocab 151936 --chunk 2048 --repeat 5 --peak-tflops "$PEAK" "$@"
