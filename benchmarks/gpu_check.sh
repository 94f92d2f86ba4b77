#!/usr/bin/env bash
# One prepared pass over obow's CUDA paths, for a machine with one CUDA GPU and obow's dependencies installed.
#
#   OUT=/tmp/gpu_check DATA=/path/to/class_folders DEADLINE=420 bash benchmarks/gpu_check.sh
#
# DATA: a small labelled set with train/ and test/ class folders (a few hundred images is enough). DEADLINE:
# seconds the whole pass may take; each part gets a cap and what is left, so the script ends on its own. SKIP:
# names of parts to leave out ("install" too). Every part's output goes to $OUT/all.log and one line per part
# (exit status, seconds) to $OUT/summary.txt; the step-time tables also go to $OUT/step_time.txt. Relative
# paths are read from the repository's root. RECIPE: the recipe that the pretraining parts train (default
# cifar10_fast; the CPU dry run in tests/test_benchmarks.py gives a tiny one); RUNS: where they write (default
# /tmp/gpu_check_runs, emptied first). Parts, in order of value:
#   1. the device and the install (pip install -e . without dependencies, else PYTHONPATH=src);
#   2. benchmarks/step_time.py on the GPU: fp32 / bf16 and channels_last in alternating rounds for the CPU
#      recipe, the paper's ResNet-18 analysis recipe and its ResNet-50 recipe (64 images a GPU);
#   3. `obow pretrain` on the GPU (precision auto, channels_last) then `obow eval knn` on its checkpoint;
#   4. torchrun with one process: the NCCL init, synchronised batch norm and DDP path;
#   5. the fast test suite with a GPU visible (tests that train on `auto` then train on the GPU);
#   6. `obow pretrain` with train.compile=true;
#   7. the built-in demo on the GPU (pretraining, random-init baseline and evaluation).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
DATA=${DATA:?set DATA to a folder with train/ and test/ class folders}
DEADLINE=${DEADLINE:-420}
DEVICE=${DEVICE:-cuda} # cpu: a dry run of the plumbing on a machine without a GPU
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# shellcheck source=benchmarks/gpu_parts.sh
source benchmarks/gpu_parts.sh # part NAME CAP command...

part env 30 bash -c machine
case " ${SKIP:-} " in
    *" install "*) echo "install skipped (SKIP)" | tee -a "$OUT/summary.txt" ;;
    *) python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/all.log" 2>&1 \
        || { echo "install failed: using PYTHONPATH=src" | tee -a "$OUT/summary.txt"; export PYTHONPATH=$PWD/src; } ;;
esac
if ! command -v obow > /dev/null; then # a command (not a function), so that timeout can run it
    mkdir -p /tmp/gpu_check_bin
    printf '#!/bin/sh\nexec python3 -m obow "$@"\n' > /tmp/gpu_check_bin/obow
    chmod +x /tmp/gpu_check_bin/obow
    export PATH=/tmp/gpu_check_bin:$PATH
fi

ST="python3 benchmarks/step_time.py --device $DEVICE --threads 4 --precision bf16 --warmup 2 --repeats 6"
part step_time_cifar10_fast 45 bash -c "$ST --config cifar10_fast | tee -a $OUT/step_time.txt"
part step_time_r18 60 bash -c "$ST --config imagenet20_resnet18_full | tee -a $OUT/step_time.txt"
part step_time_r50 75 bash -c "$ST --config imagenet_resnet50_full --batch 64 | tee -a $OUT/step_time.txt"

RUN=${RUNS:-/tmp/gpu_check_runs}
RECIPE=${RECIPE:-cifar10_fast}
rm -rf "$RUN"
TINY="optim.epochs=2 optim.warmup_epochs=1 data.num_workers=4 data.batch_size=64 train.device=$DEVICE train.precision=auto train.channels_last=true"
part pretrain 90 bash -c "obow pretrain --config $RECIPE --data $DATA/train --out $RUN/plain $TINY \
    && obow eval knn --checkpoint $RUN/plain/checkpoint.pt --data $DATA --device $DEVICE"
part torchrun_nccl 60 python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m obow.cli pretrain --config "$RECIPE" --data "$DATA/train" --out "$RUN/ddp" $TINY train.sync_batchnorm=true
# one process (-o addopts: the GPU machines may lack pytest-xdist, and the tests would share one GPU)
part pytest 200 python3 -m pytest -q -rf -p no:cacheprovider --maxfail 20 -o addopts="-ra"
part pretrain_compile 120 obow pretrain --config "$RECIPE" --data "$DATA/train" --out "$RUN/compiled" $TINY train.compile=true
part demo 240 obow demo --out "$RUN/demo"

echo "total $(($(date +%s) - T0))s" | tee -a "$OUT/summary.txt"
