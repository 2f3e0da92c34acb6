#!/bin/bash
# The same tiny job trained by two checkouts, per layout (1 process, DDP over 2, disaggregated
# 1 target + 1 drafter rank, DFlash2 alone and over 2, and a resume from step 3), deterministic
# on CPU; prints each layout's per-step losses side by side and whether they are bit-equal.
#   bash benchmarks/same_losses.sh OLD_CHECKOUT [NEW_CHECKOUT (default: this one)]
# A checkout from before the config's cut by owner takes the old keys (model.*, train.save_every);
# the new one runs with objective.accept_until_fail=false, the objective of before.
set -euo pipefail
OLD=$(realpath "$1"); NEW=$(realpath "${2:-$(dirname "$0")/..}")
WORK=$(mktemp -d); PY=${PYTHON:-python}
PYTHONPATH="$NEW:$NEW/tests" $PY -c "
from pathlib import Path
from conftest import make_job, tiny_qwen3
make_job(Path('$WORK/job'), tiny_qwen3(num_layers=4, hidden=32, seed=1))"
train() {  # train TREE OUT NAME NPROC KEYS...
  local tree=$1 out=$2 name=$3 nproc=$4; shift 4
  local keys; J=$WORK/job
  if grep -q "class TargetConfig" "$tree/flashdraft/config.py"; then
    keys="target.path=$J/target drafter.mask_token_id=299 drafter.num_layers=1 drafter.block_size=4 target.layer_ids=[1,2] checkpoint.save_every=${SAVE:-0} objective.accept_until_fail=false"
    D2="drafter.family=dflash2 drafter.conv_group_size=8 drafter.selector_rank=8 drafter.selector_top_k=8"
  else
    keys="model.target=$J/target model.mask_token_id=299 model.num_draft_layers=1 model.block_size=4 model.target_layer_ids=[1,2] train.save_every=${SAVE:-0}"
    D2="model.drafter=dflash2 model.conv_group_size=8 model.selector_rank=8 model.selector_top_k=8"
  fi
  keys="$keys data.path=$J/data data.token_budget=160 data.max_batch_size=4 objective.num_anchors=8 optim.lr=2e-3 train.max_steps=6 train.log_every=1 train.device=cpu train.deterministic=true train.output_dir=$out/$name"
  local extra=() a
  for a in "$@"; do if [ "$a" = D2 ]; then extra+=($D2); else extra+=("$a"); fi; done
  if [ "$nproc" = 1 ]; then
    (cd "$tree" && PYTHONPATH="$tree" $PY -m flashdraft.cli train $keys ${extra[@]+"${extra[@]}"}) > "$out/$name.log" 2>&1
  else
    (cd "$tree" && PYTHONPATH="$tree" $PY -m torch.distributed.run --nproc-per-node "$nproc" \
      --master-port $((29500 + RANDOM % 1000)) -m flashdraft.cli train $keys ${extra[@]+"${extra[@]}"}) > "$out/$name.log" 2>&1
  fi
}
for side in old new; do
  tree=$OLD; [ $side = new ] && tree=$NEW
  out=$WORK/$side; mkdir -p "$out"
  train "$tree" "$out" colocated1 1
  train "$tree" "$out" ddp2 2
  train "$tree" "$out" disaggregated2 2 pipeline.placement=disaggregated pipeline.target_ranks=1 train.collective_timeout_s=60
  train "$tree" "$out" dflash2 1 D2
  train "$tree" "$out" dflash2_ddp2 2 D2
  SAVE=3 train "$tree" "$out" resume 1
  rm -rf "$out/resume/checkpoints/step_00000006" "$out/resume/checkpoints/latest"
  SAVE=3 train "$tree" "$out" resume 1   # resumes from step 3
done
$PY - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
def losses(side, name):
    rows = [json.loads(line) for line in open(f"{work}/{side}/{name}/metrics.jsonl")]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]
for name in ("colocated1", "ddp2", "disaggregated2", "dflash2", "dflash2_ddp2", "resume"):
    old, new = losses("old", name), losses("new", name)
    print(f"{name:15s} {'bit-equal' if old == new else 'DIFFERENT'}  old {old}\n{'':15s}            new {new}")
PY
