#!/usr/bin/env bash
# Table 2 row seeds trained on a lent GPU, continuing the published table in this folder, plus one row seed
# already trained on the CPU trained again on the GPU (how far a device moves a result at the same plan).
#
#   DATA=.gpu_data OUT=/tmp/out DEADLINE=450 bash docs/results/tables/cifar10-table2/gpu.sh
#
# DATA: the table's images, train/ (the first 500 images of each CIFAR-10 class) and test/ (all 10,000).
# ROWS and SEEDS: the rows and seeds to train on the GPU (every row at every seed; default rows 7 and 8, seed 1);
# AGAIN: the row seed trained again, ROW:SEED (default 3:0).
# The recipe's one loader worker feeds about 370 images/s, a GPU step of this network wants about 3,000: the
# copy of the recipe in this checkout is given WORKERS loader workers (each run's config.yaml records it).
# The plan (steps per row) and the precision (fp32) come from plan.json here, whatever the machine.
# What comes back in $OUT: summary.txt, all.log and runs.tgz (every run's result.json, log.jsonl and
# config.yaml, and each folder's table.json / table.md).
set -u
cd "$(dirname "$0")/../../../.."
DATA=${DATA:?set DATA to a folder with train/ and test/}
OUT=${OUT:?set OUT}
DEADLINE=${DEADLINE:-450}
WORKERS=${WORKERS:-4}
ROWS=${ROWS:-7 8}
SEEDS=${SEEDS:-1}
AGAIN=${AGAIN:-3:0}
RUNS=${RUNS:-/tmp/gpu_table2}
T=docs/results/tables
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"; } > "$OUT/summary.txt" 2>&1
sed -i "s/^  num_workers: 1\$/  num_workers: $WORKERS/" src/obow/config/recipes/cifar10_fast.yaml
grep -n "num_workers" src/obow/config/recipes/cifar10_fast.yaml >> "$OUT/summary.txt"

# the published table without the row seed trained again, so that --results-from leaves it to train here
row=${AGAIN%%:*} seed=${AGAIN#*:}
mkdir -p "$RUNS/again_from"
cp "$T/cifar10-table2/plan.json" "$RUNS/again_from/"
python3 - "$T/cifar10-table2/table.json" "$RUNS/again_from/table.json" "$row" "$seed" << 'EOF'
import json, sys
from obow.experiments.tables.catalog import TABLES
record = json.load(open(sys.argv[1]))
slug = TABLES["table2"].rows[int(sys.argv[3]) - 1].slug
for r in record["rows"]:
    if r["slug"] == slug:
        r["runs"] = [run for run in r["runs"] if run["seed"] != int(sys.argv[4])]
json.dump(record, open(sys.argv[2], "w"))
print("trained again:", slug, "seed", sys.argv[4])
EOF

common=(--data "$DATA" --per-class 500 --minutes 25 --shared-from "$T/cifar10-table1" --curve-every 8)
# shellcheck disable=SC2086
OMP_NUM_THREADS=4 python3 -m obow tables run table2 "${common[@]}" --out "$RUNS/gpu" \
    --results-from "$T/cifar10-table2" --rows $ROWS --seeds $SEEDS --jobs 2 > "$OUT/all.log" 2>&1 &
pids=$!
OMP_NUM_THREADS=4 python3 -m obow tables run table2 "${common[@]}" --out "$RUNS/again" \
    --results-from "$RUNS/again_from" --rows "$row" --seeds "$seed" --jobs 1 > "$OUT/again.log" 2>&1 &
pids="$pids $!"
# at the deadline SIGTERM to the two tables alone (they stop their runs at a checkpoint), not to their process
# groups: a loader worker killed under a training process leaves it waiting on the worker's queue
alive() { for p in $pids; do kill -0 "$p" 2> /dev/null && return 0; done; return 1; }
while alive && [ $(($(date +%s) - T0)) -lt $((DEADLINE - 40)) ]; do sleep 2; done
kill -TERM $pids 2> /dev/null
for _ in $(seq 15); do alive || break; sleep 2; done
kill -KILL $pids 2> /dev/null
wait
echo "tables done after $(($(date +%s) - T0))s" >> "$OUT/summary.txt"
grep -h "done\|Error\|error" "$OUT/all.log" "$OUT/again.log" | tail -n 20 >> "$OUT/summary.txt"
(cd "$RUNS" && find . \( -name result.json -o -name log.jsonl -o -name config.yaml -o -name "table.*" \) -print0 \
    | tar czf "$OUT/runs.tgz" --null -T -)
echo "total $(($(date +%s) - T0))s" >> "$OUT/summary.txt"
