#!/usr/bin/env bash
# A tensor-parallel target on 2 GPUs (NCCL, DTensor): `flashdraft eval --tensor-parallel 2` on a
# small saved target and drafter against the same eval unsharded. PASS when both are lossless
# and give the same tau and per-slot acceptance. On a machine with fewer than 2 GPUs it says
# SKIP and exits 3 (never 0: it checked nothing). SMOKE=1 runs it on 2 CPU ranks (gloo) instead,
# to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-gpu_results} PYTHONPATH=$PWD
if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu
else
  device=cuda
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" -lt 2 ]; then
    echo "sharded-target check: SKIP: sharded_eval needs 2 GPUs, $gpus here"
    exit 3
  fi
fi
work="$OUT/sharded"
mkdir -p "$work"
args=(eval --target "$work/target" --prompts "$work/prompts.jsonl" --max-new-tokens 48
      --device "$device" --no-eos --dtype float32)  # fp32: a sharded all-reduce's summation order cannot flip a near tie
# the drafter, and the n-gram baseline (its drafts are often accepted: the verify path's other branch);
# SMOKE: the baseline only (each launch costs seconds of imports on a small CPU)
kinds=(drafter ngram); [ "${SMOKE:-0}" = 1 ] && kinds=(ngram)
extra_for() {  # the eval's flags of one kind, in $extra
  if [ "$1" = ngram ]; then extra=(--baseline ngram --block-size 8); else extra=(--drafter "$work/drafter"); fi
}
unsharded=()
for kind in "${kinds[@]}"; do
  extra_for "$kind"
  unsharded+=("$(printf '%q ' "${args[@]}" "${extra[@]}" --output "$work/$kind-whole.json")")
done
# one process: the small target and drafter, then the unsharded evals (each a `flashdraft eval`, as the CLI runs it)
python - "$work" "${unsharded[@]}" <<'PY' || exit 1
import contextlib, io, json, shlex, sys
from pathlib import Path
import torch
from flashdraft.cli import main
from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel
from flashdraft.toy import tiny_causal_lm
work = Path(sys.argv[1])
model = tiny_causal_lm(512, num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, seed=0, max_position_embeddings=1024)
model.save_pretrained(work / "target")
drafter = DFlashDrafter.for_target(TargetModel(model, [0, 2, 3]), num_layers=1, block_size=8, mask_token_id=511)
drafter.reset_parameters(std=0.2, generator=torch.Generator().manual_seed(0))
drafter.save_pretrained(work / "drafter")
g = torch.Generator().manual_seed(1)
lines = [json.dumps({"input_ids": torch.randint(0, 500, (24,), generator=g).tolist()}) for _ in range(4)]
(work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
for cmd in sys.argv[2:]:
    with contextlib.redirect_stdout(io.StringIO()):
        if main(shlex.split(cmd)):
            sys.exit(1)
PY
for kind in "${kinds[@]}"; do
  extra_for "$kind"
  torchrun --standalone --nproc-per-node=2 -m flashdraft.cli "${args[@]}" "${extra[@]}" --tensor-parallel 2 \
    --output "$work/$kind-tp2.json" > /dev/null || exit 1
done
# the comparison (JSON only: no torch import)
python - "$work" <<'PY'
import json, sys
from pathlib import Path
work, ok = Path(sys.argv[1]), True
for kind in [k for k in ("drafter", "ngram") if (work / f"{k}-tp2.json").is_file()]:
    a, b = (json.loads((work / f"{kind}-{f}.json").read_text()) for f in ("whole", "tp2"))
    good = (a["lossless"] and b["lossless"] and a["tau"] == b["tau"]
            and a["per_position_acceptance"] == b["per_position_acceptance"])
    ok &= good
    s = b["target_sharding"]
    print(f"sharded target (tensor parallel 2), {kind}: tau {b['tau']:.3f} vs unsharded {a['tau']:.3f}, lossless "
          f"{b['lossless']}, weights per rank {s['weight_bytes_per_rank'] / 2**20:.1f} MiB of "
          f"{s['weight_bytes_unsharded'] / 2**20:.1f} MiB: {'PASS' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
