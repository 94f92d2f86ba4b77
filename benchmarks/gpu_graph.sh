#!/usr/bin/env bash
# "The graphed step" (train.compile=graph: the eager step captured once as a CUDA graph and replayed, no compiler)
# measured in one prepared pass that returns numbers even when it is cut, for a machine with one CUDA GPU and obow's
# dependencies installed.
#
#   OUT=/tmp/gpu_graph C10=/path/cifar10 INETTE=/path/imagenette DEADLINE=420 bash benchmarks/gpu_graph.sh
#
# C10: CIFAR-10 with a train/ class folder (1,000 images a class are read: data.images_per_class); INETTE: Imagenette
# (160 px) with a train/ class folder. DEADLINE: seconds the whole pass may take (each part gets a cap and what is
# left; CAPX multiplies every cap). DEVICE=cpu: a dry run of the plumbing on a machine without a GPU, the tape standing in for the CUDA graph
# (with SMALL=1: tiny batches and steps). SKIP: parts to leave out.
# Every measurement is appended to a JSON-lines file the moment it is made (graph.jsonl: the smoke test's results;
# throughput.jsonl: each warm-up and each timed round of each setting, with the GPU's peak memory and the capture's
# time), so a part stopped by its cap keeps what it measured. Also in $OUT: summary.txt (one line per part, its
# exit status and time), all.log, throughput.json (the finished parts' medians) and throughput.md.
# The caps come from measured times: a cold process spends 10-15 s on imports, the device pipeline's cache and
# cuDNN's tuning before its first timed step (a first benchmark process took over 45 s on an H200), the eager
# cifar10_resnet18 step at batch 512 took 0.2 s (2,520 images/s, H100, 2026-11-27; 5,689 eager and 10,908 graphed on an H200,
# 2026-11-29, when in20 and r50 needed 16-18 s before their first round; on 2026-11-30 in20 took 39 s and r50 69 s of
# their 70 s caps: r50 now has 90 s); the cache is decoded once ($CACHE) and shared.
# Parts, in order of value:
#   smoke: cifar10_resnet18 at batch 512, bf16 + channels_last, device pipeline (benchmarks/gpu_graph.py): the
#          capture's time and the first replay's, 50 steps graphed against 50 eager from one state (losses, and
#          every tensor of the model at the end), then 20 replays under torch.cuda.set_sync_debug_mode("error");
#   c10r18_512, c10fast_512: train.compile off against graph, end to end and step alone, device pipeline, bf16 +
#          channels_last, batch 512, median of 3 alternating rounds of 30 timed steps after 6 warm-up steps (the
#          first logged; the capture in the warm-up, reported apart);
#   c10r18_rec, c10fast_rec: the same at the recipes' own batch and precision (fp32: TF32 on the tensor cores now);
#   in20, r50: imagenet20_resnet18_full and imagenet_resnet50_full at their recipes' batch (r50 at 128), if time remains;
#   views_render, views_noblur, views_workers: the device views on Imagenette at 160 px (render alone, without the
#          blur) against the loader workers on this machine's cores (benchmarks/render.py, loader_throughput.py);
#   render_in20, profile_in20: imagenet20_resnet18_full's render eager, dense, with hue slots (since 2026-11-30) and
#          graphed at its batch (160 px), and
#          a profile of 5 graphed steps end to end (benchmarks/gpu_profile.py): where the end-to-end rate goes (each
#          stream's kernel time and longest kernels since 2026-11-30);
#   render_in20_compiled: its render with hue slots, compiled by Inductor and graphed (RENDER_BACKEND=aot_eager: a
#          dry run's quick trace).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_graph_out}
C10=${C10:?set C10 to CIFAR-10 class folders (train/)}
INETTE=${INETTE:?set INETTE to Imagenette class folders (train/)}
DEADLINE=${DEADLINE:-420}
DEVICE=${DEVICE:-cuda}
SMALL=${SMALL:-0}
CACHE=${CACHE:-/tmp/obow_cache}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}

# shellcheck source=benchmarks/gpu_parts.sh
source benchmarks/gpu_parts.sh # part NAME CAP command...

if [ "$SMALL" = 1 ]; then # the dry run: every part, tiny, its caps CAPX times the GPU's (a loaded 2-core CPU)
    CAPX=${CAPX:-6}
    B_BIG="data.batch_size=8" B_REC="data.batch_size=8" B_R50="data.batch_size=4" IPC="data.images_per_class=8"
    SMX="--steps 8 --replays 2 --min-images 32" TPX="--warmup 5 --steps 1 --rounds 1 --min-images 32"
    RX="--warmup 1 --steps 1 --rounds 1 data.batch_size=8" LX="--workers 1 --samples 16 --steps 1 --batch 8"
    PX="--steps 1 --warmup 2 data.batch_size=8"
else
    CAPX=${CAPX:-1}
    B_BIG="data.batch_size=512" B_REC="" B_R50="data.batch_size=128" IPC="data.images_per_class=1000"
    SMX="--steps 50 --replays 20" TPX="--warmup 5 --steps 30 --rounds 3"
    RX="--warmup 3 --steps 10 --rounds 3" LX="--workers 8 16 --samples 400 --steps 5 --batch 256" VB="data.batch_size=256"
    PX="--steps 5 --warmup 8"
fi
STANDIN=""
FAST="train.precision=bf16 train.channels_last=true"
if [ "$DEVICE" = cpu ]; then
    STANDIN="--stand-in"                                 # the tape: what a CUDA graph replays, on a CPU
    FAST="train.precision=fp32 train.channels_last=true" # bf16 is emulated on some CPUs
fi
# shellcheck disable=SC2086
TP="python3 benchmarks/throughput.py --device $DEVICE --pipelines device --cache-dir $CACHE --json $OUT/throughput.json --jsonl $OUT/throughput.jsonl --compile off graph --measures end_to_end step $STANDIN $TPX"

part env $((20 * CAPX)) bash -c machine
# shellcheck disable=SC2086
part smoke $((75 * CAPX)) python3 benchmarks/gpu_graph.py --device "$DEVICE" --cache-dir "$CACHE" --jsonl "$OUT/graph.jsonl" $STANDIN \
    $SMX --config cifar10_resnet18 --data "$C10/train" $IPC $B_BIG $FAST
part c10r18_512 $((95 * CAPX)) $TP --config cifar10_resnet18 --data "$C10/train" $IPC $B_BIG $FAST
part c10fast_512 $((65 * CAPX)) $TP --config cifar10_fast --data "$C10/train" $IPC $B_BIG $FAST
part c10r18_rec $((55 * CAPX)) $TP --config cifar10_resnet18 --data "$C10/train" $IPC $B_REC
part c10fast_rec $((45 * CAPX)) $TP --config cifar10_fast --data "$C10/train" $IPC $B_REC
part in20 $((70 * CAPX)) $TP --config imagenet20_resnet18_full --data "$INETTE/train" $B_REC data.images_per_class=null $FAST
part r50 $((90 * CAPX)) $TP --config imagenet_resnet50_full --data "$INETTE/train" $B_R50 data.images_per_class=null $FAST
# The device views at Imagenette's own size (160 px, kept whole in the cache) against the loader workers (issue 64),
# both at batch 256 (2026-11-29 the render ran at the recipe's 64, the workers at 256: an unequal comparison):
# the render alone (images/s of source images), the render without the blur (the blur's cost is the difference), the
# worker pipeline (JPEG decoding + the same views on this machine's cores) feeding the same recipe's step.
VIEWS="--config imagenette_resnet18 --device $DEVICE --modes eager $RX ${VB:-} data.cache_size=160"
# shellcheck disable=SC2086
part views_render $((40 * CAPX)) python3 benchmarks/render.py $VIEWS
# shellcheck disable=SC2086
part views_noblur $((40 * CAPX)) python3 benchmarks/render.py $VIEWS views.blur_prob=0
# shellcheck disable=SC2086
part views_workers $((60 * CAPX)) python3 benchmarks/loader_throughput.py --config imagenette_resnet18 --data "$INETTE/train" --device "$DEVICE" $LX
# Where in20 lost half its step's rate end to end (2026-11-29: graphed step alone 3,714 images/s, end to end about
# 2,080): the render eager, dense (what a graph replays) and graphed at the recipe's batch, then a profile of a few
# graphed steps end to end (benchmarks/gpu_profile.py: device busy fraction, launches, the views' and the step's parts).
# shellcheck disable=SC2086
part render_in20 $((60 * CAPX)) python3 benchmarks/render.py --config imagenet20_resnet18_full --device "$DEVICE" --modes eager dense slots graphed $RX data.cache_size=160
# shellcheck disable=SC2086
part profile_in20 $((70 * CAPX)) python3 benchmarks/gpu_profile.py --config imagenet20_resnet18_full --data "$INETTE/train" --device "$DEVICE" --cache-dir "$CACHE" $PX data.images_per_class=null train.compile=graph $FAST
# 2026-11-30 (H200): the graphed render of in20 made 4,123 images/s against the eager 5,082, about as much device
# work a batch as the graphed step (3,638 images/s alone): end to end is the two one after the other. The dense render
# (what the graph replayed) ran every operation on every view, the hue rotation (about 30 kernels) in all 4 rounds;
# since then the graph rotates only each round's hue slots. Inductor fuses the elementwise chains: the compiled
# render against the slotted dense one and the graphed one, its compilation timed apart.
# shellcheck disable=SC2086
part render_in20_compiled $((150 * CAPX)) python3 benchmarks/render.py --config imagenet20_resnet18_full --device "$DEVICE" --modes slots compiled graphed $RX data.cache_size=160 ${RENDER_BACKEND:+--compile-backend $RENDER_BACKEND}
grep -h -A8 "alternating" "$OUT/all.log" | grep "^|\|alternating" > "$OUT/throughput.md"
echo "total $(($(date +%s) - T0))s" | tee -a "$OUT/summary.txt"
