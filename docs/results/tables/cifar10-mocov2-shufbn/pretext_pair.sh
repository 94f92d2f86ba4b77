#!/usr/bin/env bash
# The leak, paired: the table row's configuration (MoCo v2 our aug., seed 0, fp32, 1 thread), 26 steps, with plain
# batch norm (bn_splits=1) and with shuffled batch norm (bn_splits=4), instance-discrimination accuracy every 2 steps.
cd /work/main
. .venv/bin/activate
CFG=runs/tables-c10-shufbn/mocov2/moco_v2_our_aug/seed0/config.yaml
while [ ! -f runs/tables-c10-shufbn/mocov2/moco_v2_our_aug/seed0/result.json ] && ! grep -q "seed 0.*done\|finished" runs/shufbn-row4b.log; do sleep 20; done
for s in 1 4; do
  out=runs/leak/splits$s
  rm -rf $out
  obow pretrain --config $CFG --out $out moco.bn_splits=$s train.log_every=2 train.knn_every=100 train.tensorboard=false train.progress_bar=false > runs/leak/splits$s.log 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    n=$(grep -c '"iteration"' $out/log.jsonl 2>/dev/null || echo 0)
    if [ -f $out/log.jsonl ] && python3 -c "import json,sys; r=[json.loads(l) for l in open('$out/log.jsonl')]; sys.exit(0 if any(x.get('iteration',0)>=26 for x in r) else 1)"; then kill -TERM $pid; fi
    sleep 5
  done
done
echo done > runs/leak/DONE
