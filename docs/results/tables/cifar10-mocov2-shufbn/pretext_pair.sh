#!/usr/bin/env bash
# The leak, paired (pretext_accuracy.json): the table row's configuration (MoCo v2 our aug., seed 0, fp32, 1 thread:
# the config.yaml the table run wrote), 26 steps with plain batch norm (moco.bn_splits=1) and with shuffled batch
# norm (4), the instance-discrimination accuracy logged every 2 steps. Run from the repository root after the table:
#   bash docs/results/tables/cifar10-mocov2-shufbn/pretext_pair.sh runs/tables-c10-shufbn/mocov2/moco_v2_our_aug/seed0/config.yaml
# (row 4); row 3, MoCo v2 with its own views, into another folder (the second argument, default runs/leak):
#   bash docs/results/tables/cifar10-mocov2-shufbn/pretext_pair.sh runs/tables-c10-shufbn/mocov2/moco_v2/seed0/config.yaml runs/leak-row3
set -u
CFG=${1:?give the config.yaml of the table run}
LEAK=${2:-runs/leak}
mkdir -p "$LEAK"
for s in 1 4; do
  out=$LEAK/splits$s
  rm -rf "$out"
  obow pretrain --config "$CFG" --out "$out" moco.bn_splits=$s train.log_every=2 train.knn_every=100 \
    train.tensorboard=false train.progress_bar=false > "$LEAK/splits$s.log" 2>&1 &
  pid=$!
  while kill -0 $pid 2> /dev/null; do # stop it (SIGTERM: a checkpoint at the step) once step 26 is logged
    if [ -f "$out/log.jsonl" ] && python3 -c "import json,sys; sys.exit(0 if any(json.loads(l).get('iteration', 0) >= 26 for l in open('$out/log.jsonl')) else 1)"; then
      kill -TERM $pid
    fi
    sleep 5
  done
done
