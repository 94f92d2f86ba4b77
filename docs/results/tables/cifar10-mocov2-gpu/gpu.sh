#!/usr/bin/env bash
# The paper's central claim (issue 55) in one lent device call: the MoCo v2 table's rows OBoW (full) and MoCo v2
# (our aug.) on all 50,000 CIFAR-10 training images, side by side on the GPU, one seed a call, evaluated on the
# 10,000 test images (kNN k=200, linear probe, few-shot), then the random init if time remains; everything done
# DEADLINE seconds after this script starts. The logic is benchmarks/gpu_claim.py (its docstring says the steps):
# a probe of both rows side by side (at most 40 s a candidate) times their steps, the epochs are the most that fit
# (at least MIN_EPOCHS, or it says plainly that they do not fit and runs what does), and each row's log.jsonl (its
# kNN curve every tenth of the run) and the table's files are copied into $OUT as they grow.
#
#   OUT=$OUT bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh                    # first call: seed 0, probed
#   OUT=$OUT SEED=1 LIKE=docs/results/tables/cifar10-mocov2-gpu bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh
#
# Give the device call timeout_s=600 (DEADLINE 540 leaves a minute for the machine). The second form (a later
# call) trains another seed with the recipe, epochs and changes of the seeds merged into that folder, no probe.
# A returned $OUT is added to the folder with
#   python3 benchmarks/gpu_claim.py merge DIR_OF_THE_RETURNED_OUT docs/results/tables/cifar10-mocov2-gpu
# C10: CIFAR-10 as train/ and test/ class folders; unset, it is unpacked to /tmp/c10 from shared/data or
# ../shared/data (unpack.py there, 2-3 s). RECIPE: auto (cifar10_resnet18 when MIN_EPOCHS fit, else cifar10_fast)
# or one recipe; STEP: auto (train.compile=graph when this tree takes it and it is faster, else off), graph or off;
# BATCH (default 512; 0: the recipe's), the learning rate scaled linearly from the recipe's; EPOCHS: train that many
# whatever fits (a dry run's cut; with RECIPE and STEP given too, no probe); EXTRA: more key=value changes for every
# row; ARGS: more options of `gpu_claim.py run` (its --help); RUNS: where the runs and checkpoints go (they stay on the
# machine); RESUME=1: RUNS holds an earlier call's rows, which resume (the second call of a run longer than one call,
# on the same warm machine):
#   OUT=$OUT RECIPE=cifar10_fast STEP=graph EPOCHS=50 RUNS=/tmp/claim DEADLINE=570 bash .../gpu.sh        # timeout_s 600
#   OUT=$OUT RECIPE=cifar10_fast STEP=graph EPOCHS=50 RUNS=/tmp/claim RESUME=1 DEADLINE=300 bash .../gpu.sh  # if cut
# What comes back in $OUT (8 files at most): summary.txt, all.log, claim.json (probes, estimate, choice, progress,
# each row's config), table.json, table.md, plan.json, obow_full-seedN.log.jsonl, moco_v2_our_aug-seedN.log.jsonl.
# Dry runs on the CPU (2026-11-28, a tiny CIFAR-10 of 40 images per split, unpack.py --per-class 4; 2 busy cores;
# what they printed and returned: README.md here), each with PYTHON=.venv/bin/python C10=DIR OUT=DIR RUNS=DIR,
# the first two with ARGS="--probe-s 100 --warmup-steps 5 --probe-measure 8" (a CPU step takes seconds):
#   DEADLINE=900 BATCH=8 EPOCHS=3 bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh                  # 432 s
#   DEADLINE=330 BATCH=8 EPOCHS=30 RECIPE=cifar10_fast bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh   # cut
#   DEADLINE=600 SEED=1 LIKE=MERGED_DIR bash docs/results/tables/cifar10-mocov2-gpu/gpu.sh              # 141 s
# (the second: cut by its deadline, 323 s, the curves in OUT).
set -u
T0=$(date +%s)
cd "$(dirname "$0")/../../../.."
OUT=${OUT:?set OUT}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -z "${C10:-}" ]; then
    PACKED=""
    for d in shared/data ../shared/data; do
        if [ -z "$PACKED" ] && [ -f "$d/unpack.py" ]; then PACKED=$d; fi
    done
    [ -n "$PACKED" ] || { echo "no C10 given and no shared/data/unpack.py: set C10" | tee -a "$OUT/summary.txt"; exit 1; }
    C10=/tmp/c10
    [ -d "$C10/train" ] || "$PYTHON" "$PACKED/unpack.py" cifar10 "$C10" >> "$OUT/all.log" 2>&1
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# shellcheck disable=SC2086
exec "$PYTHON" benchmarks/gpu_claim.py run --data "$C10" --out "$OUT" --runs "${RUNS:-/tmp/gpu_claim-$T0}" \
    --t0 "$T0" --deadline "${DEADLINE:-540}" --seed "${SEED:-0}" --recipe "${RECIPE:-auto}" --step "${STEP:-auto}" \
    --batch "${BATCH:-512}" --min-epochs "${MIN_EPOCHS:-50}" --epochs "${EPOCHS:-0}" ${LIKE:+--like "$LIKE"} ${RESUME:+--resume} \
    --extra ${EXTRA:-} ${ARGS:-}
