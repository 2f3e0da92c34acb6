#!/usr/bin/env bash
# The one-GPU check (issue 28), then the multi-GPU one: what CPU tests cannot show, asserted on a
# GPU machine in <= 11 minutes (the parts' limits add up to 620 s; with 2+ GPUs, gpu_multi's <= 5
# more), ending in ONE verdict that
# names every part: PASS only when every part ran and passed (exit 0); FAIL naming the failed
# parts (exit 1); INCOMPLETE when none failed but a part did not run -- a part that cannot run
# here (no second GPU, a capability the device lacks) or was not asked for is a SKIP named with
# its reason, never a pass (exit 3). Each part runs in its own process under its own `timeout`
# and writes $OUT/<part>.json as soon as it ends (a part that times out gets a JSON saying so and
# loses only its own numbers). The parts (flashdraft/bench/gpu_check.py, one function each):
#   prepare        the jobs: a random-weight target at the Qwen3-8B widths (6 layers), shards of
#                  S = 1024 / 3072, a small target with a shard of varied lengths ($JOB, not $OUT)
#   trainer_1024   the trainer's path at the 8B point with the defaults (fp32 master weights under
#   trainer_3072   bf16 autocast, 512 anchors, block 16, 5 layers): peak allocated memory against
#                  the plan of the SAME micro-batch (plan_memory(cfg, seq_len=S)) within 15 %, and
#                  max_memory_reserved plus the memory outside the allocator within the plan's margin
#   block_mask     the anchor-built flex BlockMask: < 64 MiB where the dense grid is 1.5G elements,
#                  equal to create_block_mask's
#   sinks          sink gradients under bf16 autocast (norm gain 3) within 2 % of fp64
#   deterministic  two runs with train.deterministic=true in two processes: losses and weights bit-equal
#   graphs         compiled graphs (torch._dynamo counters) over a run with varied lengths
#   pipeline       the pipelined trainer's losses equal to the sequential one's
#   flex_compile   the first CUDA compile of the drafter's flex attention, forward and backward (GQA,
#                  four lengths) against the dense oracle: errors, graphs, compile time
#   gpu_multi      benchmarks/gpu_multi.sh (NCCL links, DDP resume, contexts, TP-2 eval; 2 GPUs):
#                  with fewer GPUs a SKIP naming its parts
# Then copy the numbers into docs/benchmarks.md.
#
#   bash benchmarks/gpu_checks.sh            # on the GPU machine
#   SMOKE=1 bash benchmarks/gpu_checks.sh    # every part's code path on CPU at toy sizes (gpu_multi: its own SMOKE)
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
        pipeline:70 flex_compile:90)
every="prepare trainer_1024 trainer_3072 block_mask sinks deterministic graphs pipeline flex_compile gpu_multi"
wanted=" ${PARTS:-$every} "
case "$wanted" in *trainer*|*deterministic*|*graphs*|*pipeline*) wanted="$wanted prepare " ;; esac
passed=() failed=() skipped=()
record() {  # record PART STATUS [WHY]: one part's outcome, for the verdict
  case $2 in
    0) passed+=("$1") ;;
    3) skipped+=("$1 ($3)") ;;
    *) failed+=("$1") ;;
  esac
}
for entry in "${limits[@]}"; do
  part=${entry%%:*} limit=$(( ${entry##*:} * scale ))
  if [[ "$wanted" != *" $part "* ]]; then
    record "$part" 3 "not asked for: PARTS=${PARTS:-}"
    continue
  fi
  timeout -k 10 "$limit" python -m flashdraft.bench.gpu_check "$part" --job "$JOB" --out "$OUT" \
    "${smoke[@]}" > "$OUT/$part.txt" 2>&1
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then  # killed: say so in the part's JSON
    printf '{"part": "%s", "ok": false, "status": "fail", "error": "timed out after %s s"}\n' "$part" "$limit" \
      > "$OUT/$part.json"
    echo "$part: FAIL timed out after $limit s" >> "$OUT/$part.txt"
  fi
  why=$(python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("skipped", ""))' "$OUT/$part.json" 2>/dev/null)
  record "$part" $rc "$why"
  tail -n 1 "$OUT/$part.txt"
done
if [[ "$wanted" != *" gpu_multi "* ]]; then
  record gpu_multi 3 "not asked for: PARTS=${PARTS:-}"
elif [ "${SMOKE:-0}" = 1 ]; then
  record gpu_multi 3 "SMOKE: it has its own, SMOKE=1 bash benchmarks/gpu_multi.sh"
else
  bash benchmarks/gpu_multi.sh 2>&1 | tee "$OUT/gpu_multi.txt"
  rc=${PIPESTATUS[0]}
  record gpu_multi "$rc" "$(grep -o 'SKIP: .*' "$OUT/gpu_multi.txt" | tail -n 1 | cut -c7-)"
fi
join() { local out="" item; for item in "$@"; do out+="${out:+, }$item"; done; echo "$out"; }
if [ ${#failed[@]} -gt 0 ]; then
  verdict="FAIL: failed $(join "${failed[@]}")"; status=1
elif [ ${#skipped[@]} -gt 0 ]; then
  verdict="INCOMPLETE: nothing failed, but not every part ran"; status=3
else
  verdict="PASS: every part ran and passed"; status=0
fi
[ ${#passed[@]} -gt 0 ] && verdict="$verdict; passed: $(join "${passed[@]}")"
[ ${#skipped[@]} -gt 0 ] && verdict="$verdict; SKIPPED: $(join "${skipped[@]}")"
echo "gpu_checks: $verdict (JSON per part in $OUT)"
exit $status
