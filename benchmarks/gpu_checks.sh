#!/usr/bin/env bash
# The one-GPU check (issue 28): what CPU tests cannot show, asserted on one GPU in <= 9 minutes
# (the parts' limits add up to 530 s). Each part runs in its own process under its own `timeout`
# and writes $OUT/<part>.json as soon as it ends (a part that times out gets a JSON saying so and
# loses only its own numbers); the script exits 1 when any part failed. The parts
# (flashdraft/bench/gpu_check.py, one function each):
#   prepare        the jobs: a random-weight target at the Qwen3-8B widths (6 layers), shards of
#                  S = 1024 / 3072, a small target with a shard of varied lengths ($JOB, not $OUT)
#   trainer_1024   the trainer's path at the 8B point with the defaults (fp32 master weights under
#   trainer_3072   bf16 autocast, 512 anchors, block 16, 5 layers): peak memory against
#                  flashdraft.plan.plan_memory(cfg).peak_bytes within 15 %
#   block_mask     the anchor-built flex BlockMask: < 64 MiB where the dense grid is 1.5G elements,
#                  equal to create_block_mask's
#   sinks          sink gradients under bf16 autocast (norm gain 3) within 2 % of fp64
#   deterministic  two runs with train.deterministic=true: losses and weights bit-equal
#   graphs         compiled graphs (torch._dynamo counters) over a run with varied lengths
#   pipeline       the pipelined trainer's losses equal to the sequential one's
# With 2+ GPUs it then runs benchmarks/gpu_multi.sh (NCCL links, DDP resume, contexts, TP-2 eval:
# <= 5 more minutes). Then copy the numbers into docs/benchmarks.md.
#
#   bash benchmarks/gpu_checks.sh            # on the GPU machine
#   SMOKE=1 bash benchmarks/gpu_checks.sh    # every part's code path on CPU at toy sizes
#   PARTS="sinks block_mask" bash benchmarks/gpu_checks.sh   # some parts only (prepare is kept when needed)
#   TIME_SCALE=2 ...                         # every part's limit doubled (SMOKE: 4 unless given)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-gpu_results} PYTHONPATH=$PWD
mkdir -p "$OUT"
if [ -z "${JOB:-}" ]; then  # the jobs' files (GBs at 8B widths): a temporary directory unless JOB names one
  JOB=$(mktemp -d)
  trap 'rm -rf "$JOB"' EXIT
fi
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1 | tee "$OUT/env.txt"
smoke=() scale=${TIME_SCALE:-1}
# SMOKE: a small shared CPU box is slower than the GPU at these toy sizes: 4x the limits
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke) scale=${TIME_SCALE:-4}
# part:seconds; trainer parts need prepare first
limits=(prepare:70 trainer_1024:100 trainer_3072:90 block_mask:30 sinks:30 deterministic:80 graphs:60
        pipeline:70)
wanted=" ${PARTS:-prepare trainer_1024 trainer_3072 block_mask sinks deterministic graphs pipeline} "
case "$wanted" in *trainer*|*deterministic*|*graphs*|*pipeline*) wanted="$wanted prepare " ;; esac
status=0
for entry in "${limits[@]}"; do
  part=${entry%%:*} limit=$(( ${entry##*:} * scale ))
  [[ "$wanted" == *" $part "* ]] || continue
  timeout -k 10 "$limit" python -m flashdraft.bench.gpu_check "$part" --job "$JOB" --out "$OUT" \
    "${smoke[@]}" > "$OUT/$part.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # killed: say so in the part's JSON
      printf '{"part": "%s", "ok": false, "error": "timed out after %s s"}\n' "$part" "$limit" > "$OUT/$part.json"
      echo "$part: FAIL timed out after $limit s" >> "$OUT/$part.txt"
    fi
  fi
  tail -n 1 "$OUT/$part.txt"
done
gpus=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${gpus:-0}" -ge 2 ] && [ "${SMOKE:-0}" != 1 ]; then
  bash benchmarks/gpu_multi.sh 2>&1 | tee "$OUT/gpu_multi.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_checks: $([ $status = 0 ] && echo PASS || echo FAIL) (JSON per part in $OUT)"
exit $status
