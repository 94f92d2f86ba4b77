#!/usr/bin/env bash
# "Feed the GPU" measured in one prepared pass, for a machine with one CUDA GPU and obow's dependencies installed.
#
#   OUT=/tmp/gpu_tp C10=/path/cifar10 INETTE=/path/imagenette DEADLINE=520 bash benchmarks/gpu_throughput.sh
#
# C10: CIFAR-10 as train/ and test/ class folders (all 50,000 + 10,000 for the quality part); INETTE: Imagenette
# (160 px) with a train/ class folder (a few hundred images are enough: benchmarks/throughput.py repeats them).
# DEADLINE: seconds the whole pass may take (each part gets a cap and what is left). DEVICE=cpu: a dry run of
# the plumbing on a machine without a GPU (with SMALL=1: tiny batches and steps). SKIP: parts to leave out.
# Writes to $OUT: summary.txt (one line per part), all.log, throughput.json and throughput.md (from
# benchmarks/throughput.py), profile.txt, libraries.txt, quality.jsonl (each quality run's epoch records).
# Parts, in order of value (each capped; a lent call lasts at most 10 minutes and the whole lease 15):
#   1. end-to-end throughput, loader alone and step alone: cifar10_resnet18 at the recipe's settings, workers
#      against device pipeline (the baseline in the same run); then the device pipeline alone at a large batch
#      in bf16 + channels_last for cifar10_resnet18 (512 and 1024) and cifar10_fast, and at the recipe's batch for the two
#      ImageNet-scale recipes (their workers baseline is docs/results/gpu_h100.md's step alone, an upper bound);
#   2. equal-steps quality: cifar10_resnet18, 3 epochs of 10,000 CIFAR-10 images, workers and device pipeline,
#      seeds 0 and 1, the four runs at once, kNN (k=200) on the 10,000 test images;
#   3. torch.profiler of a few steps (benchmarks/gpu_profile.py);
#   4. obow's batched crops against kornia and torchvision (benchmarks/views_libraries.py);
#   5. cifar10_fast at its recipe's settings, workers against device; torch.compile (train.compile) at a large batch;
#   6. batchlr: batch 512 with a linearly scaled learning rate against the recipe's 128 at equal epochs (BEPOCHS,
#      default 3), all of CIFAR-10, seeds 0 and 1, kNN on the test images (batchlr.jsonl).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_throughput_out}
C10=${C10:?set C10 to CIFAR-10 class folders (train/, test/)}
INETTE=${INETTE:?set INETTE to Imagenette class folders (train/)}
DEADLINE=${DEADLINE:-520}
DEVICE=${DEVICE:-cuda}
WORKERS=${WORKERS:-12}
SMALL=${SMALL:-0}
CACHE=${CACHE:-/tmp/obow_cache}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}

# shellcheck source=benchmarks/gpu_parts.sh
source benchmarks/gpu_parts.sh # part NAME CAP command...

if [ "$SMALL" = 1 ]; then # the dry run: every part, tiny
    S1=1 S2=1 B_BIG=16 B_HUGE=32 B_R50=8 B_LIB=16 B_REC="data.batch_size=8" QUAL="data.batch_size=16 data.images_per_class=8"
    TPX="--warmup 1 --rounds 1 --min-images 64" PROFX="--warmup 1 --steps 1" QEPOCHS=1
    BDIV=16 BEPOCHS=1 BQUAL="data.images_per_class=8"
else
    S1=15 S2=8 B_BIG=512 B_HUGE=1024 B_R50=128 B_LIB=512 B_REC="" QUAL="data.images_per_class=1000" TPX="--warmup 3" PROFX=""
    QEPOCHS=3 BDIV=1 BEPOCHS=${BEPOCHS:-3} BQUAL=""
fi
TP="python3 benchmarks/throughput.py --device $DEVICE --workers $WORKERS --cache-dir $CACHE --json $OUT/throughput.json $TPX"
FAST="train.precision=bf16 train.channels_last=true"
[ "$DEVICE" = cpu ] && FAST="train.precision=fp32 train.channels_last=true" # bf16 is emulated on some CPUs
export OUT C10 INETTE DEVICE WORKERS CACHE B_BIG B_LIB B_REC QUAL QEPOCHS FAST PROFX BEPOCHS BQUAL BDIV

part env 20 bash -c machine
part c10r18 80 $TP --config cifar10_resnet18 --data "$C10/train" --steps $S1 $B_REC --label "recipe: batch 128, fp32"
part c10r18_big 50 $TP --pipelines device --diagnose every logged --config cifar10_resnet18 --data "$C10/train" --steps $S2 data.batch_size=$B_BIG $FAST
# batch 1024: the step's launches are the same as at 512 (benchmarks/step_ops.py), its arithmetic doubles
part c10r18_huge 50 $TP --pipelines device --config cifar10_resnet18 --data "$C10/train" --steps $S2 data.batch_size=$B_HUGE $FAST
part c10fast_big 35 $TP --pipelines device --config cifar10_fast --data "$C10/train" --steps $S2 data.batch_size=$B_BIG $FAST
part in20 40 $TP --pipelines device --config imagenet20_resnet18_full --data "$INETTE/train" --steps $S2 $B_REC data.images_per_class=null $FAST
part r50 45 $TP --pipelines device --config imagenet_resnet50_full --data "$INETTE/train" --steps $S2 data.batch_size=$B_R50 data.images_per_class=null $FAST

c10run() { # c10run NAME EPOCHS key=value...: a cifar10_resnet18 run on $C10 in the background, kNN at its end
    local name=$1 epochs=$2
    shift 2
    mkdir -p /tmp/runs
    python3 -m obow pretrain --config cifar10_resnet18 --data "$C10/train" --val "$C10/test" --out "/tmp/runs/$name" \
        data.cache_dir=$CACHE train.device=$DEVICE optim.epochs=$epochs train.knn_every=$epochs train.knn_k=200 \
        train.progress_bar=false train.tensorboard=false "$@" > "/tmp/runs/$name.log" 2>&1 &
}
epoch_records() { # epoch_records NAME...: the end of each run's log, and its epoch records tagged with its name
    local name
    for name in "$@"; do
        tail -n 3 "/tmp/runs/$name.log" >&2 # to all.log
        python3 -c "import json,sys; [print(json.dumps({'run': sys.argv[2], **json.loads(l)})) for l in open(sys.argv[1]) if 'epoch_time_s' in l]" \
            "/tmp/runs/$name/log.jsonl" "$name"
    done
}
RUNS="c10run epoch_records"
quality() { # four runs at once (workers and device pipeline, seeds 0 and 1), then their epoch records
    local seed pipe
    for seed in 0 1; do
        for pipe in workers device; do
            # shellcheck disable=SC2086
            c10run "$pipe-s$seed" $QEPOCHS data.pipeline=$pipe data.num_workers=$((WORKERS / 2)) train.seed=$seed $QUAL
        done
    done
    wait
    epoch_records workers-s0 device-s0 workers-s1 device-s1 > "$OUT/quality.jsonl"
}
part quality 110 bash -c "$(declare -f $RUNS quality); quality"
profile() {
    python3 benchmarks/gpu_profile.py --config cifar10_resnet18 --data "$C10/train" --device $DEVICE --cache-dir $CACHE --pipeline device $PROFX --top 15 data.batch_size=$B_BIG $FAST
}
part profile 60 bash -c "$(declare -f profile); profile > $OUT/profile.txt 2>&1"
libraries() {
    python3 benchmarks/views_libraries.py --config cifar10_resnet18 --device $DEVICE --batch $B_LIB --skip torchvision
}
part libraries 40 bash -c "$(declare -f libraries); libraries > $OUT/libraries.txt 2>&1"
# second call: the recipe's own settings of cifar10_fast against workers, then torch.compile of the networks
part c10fast 60 $TP --config cifar10_fast --data "$C10/train" --steps $S1 $B_REC --label "recipe: batch 128, fp32"
part c10r18_compile 200 $TP --pipelines device --warmup 6 --config cifar10_resnet18 --data "$C10/train" --steps $S2 data.batch_size=$B_BIG $FAST train.compile=true
# the large-batch lever at equal epochs: batch 128 (lr 0.05, the recipe) against batch 512 with the learning rate
# scaled linearly with the batch (lr 0.2, Goyal et al.'s rule, the recipe's warm-up), all of CIFAR-10, device
# pipeline, fp32, seeds 0 and 1, the four runs at once; kNN (k=200) on the 10,000 test images at the end
batchlr() {
    local seed run
    for seed in 0 1; do
        for run in "128 0.05" "512 0.2"; do
            set -- $run
            # shellcheck disable=SC2086
            c10run "b$1-s$seed" $BEPOCHS data.pipeline=device data.batch_size=$(($1 / BDIV)) optim.lr=$2 train.seed=$seed $BQUAL
        done
    done
    wait
    epoch_records b128-s0 b512-s0 b128-s1 b512-s1 > "$OUT/batchlr.jsonl"
}
part batchlr 300 bash -c "$(declare -f $RUNS batchlr); batchlr"
grep -h -A8 "^$\|on .*alternating" "$OUT/all.log" | grep "^|\|alternating\|device / workers" > "$OUT/throughput.md"
echo "total $(($(date +%s) - T0))s" | tee -a "$OUT/summary.txt"
