#!/usr/bin/env bash
# "One compiled step" (issue 46, item 6) measured in one prepared pass, for a machine with one CUDA GPU and obow's
# dependencies installed.
#
#   OUT=/tmp/gpu_compile C10=/path/cifar10 INETTE=/path/imagenette DEADLINE=540 bash benchmarks/gpu_compile.sh
#
# C10: CIFAR-10 with a train/ class folder (and test/, for the monitor part); INETTE: Imagenette (160 px) with a train/ class folder (a few hundred
# images are enough: benchmarks/throughput.py repeats them). DEADLINE: seconds the whole pass may take (each part
# gets a cap and what is left). DEVICE=cpu: a dry run of the plumbing on a machine without a GPU (with SMALL=1: tiny
# batches and steps). SKIP: parts to leave out (e.g. SKIP="in20 r50" for a first call, SKIP="checks c10r18
# c10fast" for a second).
# Writes to $OUT: summary.txt (one line per part), all.log, checks.json and checks_moco.json (benchmarks/gpu_compile.py),
# render.json (benchmarks/render.py), throughput.json and throughput.md (benchmarks/throughput.py), monitor.json
# (benchmarks/monitor.py).
# Parts, in order (the two that compile no training step first: the step compiled for over 140 s on an H200, and
# benchmarks/gpu_graph.sh, the graphed step, comes before this pass):
#   render, monitor: below;
#   checks: train.compile=step replayed as CUDA graphs (mode reduce-overhead) on cifar10_resnet18 at batch 512:
#           CUDA-graph skips (must be 0, with Inductor's reasons), graph breaks, and unlogged steps under
#           torch.cuda.set_sync_debug_mode("error") (must raise nothing); checks_moco: the same for MoCo v2;
#   render: the device pipeline's render of cifar10_resnet18's views at batch 512, eager, dense and compiled
#           (benchmarks/render.py; with train.compile=step a GPU run renders compiled, on a side stream);
#   c10r18, c10fast, in20, r50: the four recipes end to end and step alone (not the loader alone) with train.compile off, networks and
#           step (reduce-overhead), device pipeline, bf16 + channels_last, at the recipe's batch (imagenet_resnet50_full
#           at 128: three runs share the GPU), each figure the median of 3 alternating rounds of 30 timed steps after
#           10 warm-up steps (the first logged; compilation is in the warm-up, reported apart as warmup_s).
#   monitor: the kNN monitor's pass of cifar10_resnet18 (10,000 training + the 10,000 test images), reading its
#           images every pass against decoding them once and keeping them (benchmarks/monitor.py).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_compile_out}
C10=${C10:?set C10 to CIFAR-10 class folders (train/)}
INETTE=${INETTE:?set INETTE to Imagenette class folders (train/)}
DEADLINE=${DEADLINE:-540}
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
CACHE=${CACHE:-/tmp/obow_cache}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}

# shellcheck source=benchmarks/gpu_parts.sh
source benchmarks/gpu_parts.sh # part NAME CAP command...

if [ "$SMALL" = 1 ]; then # the dry run: every part, tiny
    B_CHECK="data.batch_size=8" B_REC="data.batch_size=8" B_R50="data.batch_size=4"
    # the step traced by Dynamo, run by aot_eager: Inductor's C++ compiler takes minutes on a CPU
    TPX="--warmup 2 --steps 1 --rounds 1 --min-images 32 --compile-backend aot_eager"
    CHX="--warmup 2 --checked 1 --min-images 32 --compile-backend aot_eager"
    MODES="off step" # networks is Inductor's alone
    RX="--warmup 1 --steps 1 --rounds 1 --compile-backend aot_eager"
    MX="--rounds 1 --per-class 2"
else
    B_CHECK="data.batch_size=512" B_REC="" B_R50="data.batch_size=128"
    TPX="--warmup 10 --steps 30 --rounds 3" CHX="--warmup 6 --checked 3" RX="--warmup 5 --steps 30 --rounds 3"
    MX="--rounds 1 --per-class 1000"
    MODES="off networks step"
fi
FAST="train.precision=bf16 train.channels_last=true"
[ "$DEVICE" = cpu ] && FAST="train.precision=fp32 train.channels_last=true" # bf16 is emulated on some CPUs
# shellcheck disable=SC2086
TP="python3 benchmarks/throughput.py --device $DEVICE --pipelines device --cache-dir $CACHE --json $OUT/throughput.json --compile $MODES --compile-mode reduce-overhead --measures end_to_end step $TPX"

part env 20 bash -c machine
# first the parts that compile no step (a whole step compiled for over 140 s on an H200: docs/gpu.md)
# the device pipeline's render, eager against compiled (what train.compile=step renders with on a GPU), at batch 512
part render 90 python3 benchmarks/render.py --device "$DEVICE" --json "$OUT/render.json" $RX --config cifar10_resnet18 $B_CHECK
# the kNN monitor's pass, reading its images every pass against keeping them decoded (what a run does now)
part monitor 60 python3 benchmarks/monitor.py --device "$DEVICE" --json "$OUT/monitor.json" --config cifar10_resnet18 \
    --train "$C10/train" --val "$C10/test" $MX
part checks 150 python3 benchmarks/gpu_compile.py --device "$DEVICE" --cache-dir "$CACHE" --json "$OUT/checks.json" $CHX \
    --config cifar10_resnet18 --data "$C10/train" $B_CHECK $FAST
# MoCo v2: its shuffled batch norm's randperm and its queue's index_copy_ inside the CUDA graphs
part checks_moco 120 python3 benchmarks/gpu_compile.py --device "$DEVICE" --cache-dir "$CACHE" --json "$OUT/checks_moco.json" \
    $CHX --config cifar10_resnet18 --data "$C10/train" $B_CHECK $FAST model.method=mocov2 moco.queue_size=4096
part c10r18 200 $TP --config cifar10_resnet18 --data "$C10/train" $B_REC $FAST
part c10fast 200 $TP --config cifar10_fast --data "$C10/train" $B_REC $FAST
part in20 200 $TP --config imagenet20_resnet18_full --data "$INETTE/train" $B_REC data.images_per_class=null $FAST
part r50 250 $TP --config imagenet_resnet50_full --data "$INETTE/train" $B_R50 data.images_per_class=null $FAST
grep -h -A8 "alternating" "$OUT/all.log" | grep "^|\|alternating" > "$OUT/throughput.md"
echo "total $(($(date +%s) - T0))s" | tee -a "$OUT/summary.txt"
