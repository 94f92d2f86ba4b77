#!/usr/bin/env bash
# What issues 65 and 68 still ask of an AVX2-only CPU, in one prepared pass, for a session that draws such a machine
# (`grep -c avx512 /proc/cpuinfo` is 0): every command their notes name, in order of value, each part's output in
# $OUT the moment it ends.
#
#   OUT=runs/avx2 OFFICIAL=/path/to/valeoai-obow bash benchmarks/avx2_pass.sh
#
# OFFICIAL: a copy of the authors' code (valeoai/obow) for benchmarks/official_step.py; without it that part is
# skipped. SKIP: parts to leave out ("busy profile"). DRY=1: print the commands, run nothing. FORCE=1: run on a CPU
# with AVX-512 too (with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 and a
# TORCHINDUCTOR_CACHE_DIR of its own in the environment, such a CPU runs the AVX2 kernels: their numbers, not the
# seconds of an AVX2 CPU; docs/results/step_profile_cpu.md). Run it on a quiet machine, nothing beside it.
# Parts (about 35 minutes in all on a 2-core AVX2 EPYC, by the times measured on it before):
#   suite:    the default suite, timed (issue 68: at most 180 s), with its slowest tests;
#   demo:     `obow demo` at seeds 0, 1, 2 (issue 65: at most 180 s, a kNN gain of +10 or more at each);
#   official: obow's fp32 step against the authors' at identical shapes, demo and cifar10_fast (issue 65: 1.25x);
#   profile:  where an fp32 step's time goes, demo_fp32 and cifar10_fast (issue 65);
#   busy:     the demo recipe's steps quiet and beside one CPU-bound process (issue 65: at most 2.2x).
# $OUT/summary.txt: one line a part (its exit status and seconds); $OUT/machine.txt: the CPU's model and flags.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/avx2}
OFFICIAL=${OFFICIAL:-}
SKIP=${SKIP:-}
DRY=${DRY:-0}
FORCE=${FORCE:-0}

if grep -q avx512f /proc/cpuinfo 2>/dev/null && [ "$FORCE" != 1 ] && [ "$DRY" != 1 ]; then
    echo "avx2_pass: this CPU has AVX-512: these measurements are for an AVX2-only one (FORCE=1 runs them anyway)" >&2
    exit 2
fi
[ "$DRY" = 1 ] || mkdir -p "$OUT"

say() { # say LINE: printed, and kept in $OUT/summary.txt unless a dry run
    echo "$1"
    [ "$DRY" = 1 ] || echo "$1" >>"$OUT/summary.txt"
}

run_part() { # run_part NAME command...: runs it unless skipped, logs to $OUT/NAME.log, appends to summary.txt
    local name=$1
    shift
    if [[ " $SKIP " == *" $name "* ]]; then
        say "$name skipped"
        return
    fi
    if [ "$DRY" = 1 ]; then
        echo "$name: $*"
        return
    fi
    local start=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    say "$name exit $status in $((SECONDS - start)) s"
}

if [ "$DRY" != 1 ]; then
    {
        date -u +%Y-%m-%dT%H:%M:%SZ
        grep -m1 "model name" /proc/cpuinfo
        grep -m1 -o 'avx2\|avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '
        echo
        nproc
        uptime
        python -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
        git log -1 --format='tree %h %s'
    } >"$OUT/machine.txt" 2>&1
fi

run_part suite python -m pytest -q --durations=25
run_part demo python benchmarks/demo_time.py --out "$OUT/demo-time" --seeds 0 1 2 --json "$OUT/demo_time.json"
if [ -n "$OFFICIAL" ]; then
    run_part official bash -c "python benchmarks/official_step.py --official '$OFFICIAL' --config demo --threads 2 \
--rounds 7 --json '$OUT/official_step_demo.json' --obow-settings --obow-settings train.channels_last=false && \
python benchmarks/official_step.py --official '$OFFICIAL' --config cifar10_fast --threads 2 --rounds 5 \
--json '$OUT/official_step_cifar10_fast.json' --obow-settings --obow-settings train.channels_last=false"
else
    say "official skipped (no OFFICIAL: a copy of valeoai/obow)"
fi
run_part profile bash -c "python benchmarks/step_profile.py --config demo_fp32 --precision fp32 \
--json '$OUT/step_profile_demo_fp32.json' && python benchmarks/step_profile.py --config cifar10_fast \
--precision fp32 --steps 3 --json '$OUT/step_profile_cifar10_fast.json'"
run_part busy python benchmarks/busy_machine.py --rounds 3 --json "$OUT/busy_machine.json"
