#!/usr/bin/env bash
# The paper's central comparison (MoCo v2 table: row 2 OBoW (full), row 4 MoCo v2 with the same augmentations) on
# all of CIFAR-10 at a GPU budget, in one lent device call: `obow tables run mocov2 --budget EPOCHS` with the
# full-width recipe cifar10_resnet18 (RECIPE=cifar10_fast for the half width) and the device pipeline (views made
# on the GPU from a decoded cache). MoCo v2 runs with shuffled batch norm (moco.bn_splits: its automatic choice,
# sub-batches of at least 32 images; docs/faithfulness.md), the fair baseline issue 44 asks for.
#
#   C10=/tmp/c10 OUT=$OUT EPOCHS=10 DEADLINE=330 bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh
#
# C10: CIFAR-10 as train/ (all 50,000) and test/ (all 10,000) class folders. EPOCHS: pretraining epochs per row;
# ROWS (default "2 4"), SEEDS (default "0"): every row at every seed, JOBS (default 2) of them at once on the GPU;
# CURVE: kNN on the test images every CURVE epochs (default EPOCHS/10, at least 1: the issue's ten points; the
# monitor decodes the 60,000 images once and keeps them, each epoch record's monitor_time_s says what a pass took).
# EXTRA: more recipe overrides for every row.
# A run's checkpoint does not outlive the call, so EPOCHS must fit: a table run ends with its evaluations (kNN,
# linear, few-shot); at DEADLINE-30 s the table gets SIGTERM and stops at a checkpoint (what finished is kept).
# What comes back in $OUT: summary.txt, all.log, runs.tgz (each run's result.json, log.jsonl, config.yaml, and
# the table's plan.json / table.json / table.md).
# Dry run on a CPU (2026-11-27, 51 s; a tiny CIFAR-10 of 40 images per split): C10=DIR OUT=DIR EPOCHS=1
#   RECIPE=cifar10_fast EXTRA="data.batch_size=8 train.device=cpu" bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh
set -u
cd "$(dirname "$0")/../../../.."
C10=${C10:?set C10 to CIFAR-10 class folders (train/, test/)}
OUT=${OUT:?set OUT}
EPOCHS=${EPOCHS:-10}
DEADLINE=${DEADLINE:-330}
ROWS=${ROWS:-2 4}
SEEDS=${SEEDS:-0}
JOBS=${JOBS:-2}
CURVE=${CURVE:-$((EPOCHS >= 10 ? EPOCHS / 10 : 1))}
EXTRA=${EXTRA:-}
RECIPE=${RECIPE:-cifar10_resnet18}
RUNS=${RUNS:-/tmp/gpu_mocov2}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"; } > "$OUT/summary.txt" 2>&1
echo "RECIPE=$RECIPE EPOCHS=$EPOCHS ROWS=$ROWS SEEDS=$SEEDS JOBS=$JOBS CURVE=$CURVE EXTRA=$EXTRA" >> "$OUT/summary.txt"
# shellcheck disable=SC2086
python3 -m obow tables run mocov2 --data "$C10" --budget "$EPOCHS" --recipe "$RECIPE" --out "$RUNS" \
    --rows $ROWS --seeds $SEEDS --jobs "$JOBS" --curve-every "$CURVE" data.pipeline=device $EXTRA > "$OUT/all.log" 2>&1 &
pid=$!
while kill -0 $pid 2> /dev/null && [ $(($(date +%s) - T0)) -lt $((DEADLINE - 30)) ]; do sleep 2; done
kill -TERM $pid 2> /dev/null
for _ in $(seq 12); do kill -0 $pid 2> /dev/null || break; sleep 2; done
kill -KILL $pid 2> /dev/null
wait
echo "table done after $(($(date +%s) - T0))s" >> "$OUT/summary.txt"
grep -h "epoch\|done\|rror" "$OUT/all.log" | tail -n 40 >> "$OUT/summary.txt"
(cd "$RUNS" && find . \( -name result.json -o -name log.jsonl -o -name config.yaml -o -name "table.*" -o -name plan.json \) -print0 \
    | tar czf "$OUT/runs.tgz" --null -T -)
echo "total $(($(date +%s) - T0))s" >> "$OUT/summary.txt"
