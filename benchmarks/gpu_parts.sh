# Sourced by the prepared GPU passes (gpu_check.sh, gpu_throughput.sh, gpu_compile.sh): `part NAME CAP command...`
# runs one part with a timeout of min(CAP, the time left before DEADLINE seconds after T0), appends its output to
# $OUT/all.log and a line to $OUT/summary.txt; a part named in SKIP is left out. Sourcing it starts the pass:
# $OUT made, its summary.txt and all.log emptied, the clock T0 started. `part env 20 bash -c machine` records
# the machine.
mkdir -p "$OUT"
T0=$(date +%s)
: > "$OUT/summary.txt"
: > "$OUT/all.log"

machine() {
    nproc
    nvidia-smi -L 2> /dev/null
    python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
}
export -f machine

part() {
    local name=$1 cap=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*)
        echo "$name skipped (SKIP)" | tee -a "$OUT/summary.txt"
        return ;;
    esac
    local left=$((DEADLINE - ($(date +%s) - T0)))
    if [ "$left" -lt 10 ]; then
        echo "$name skipped (deadline)" | tee -a "$OUT/summary.txt"
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    local start=$(date +%s)
    echo "===== $name (cap ${cap}s): $*" >> "$OUT/all.log"
    timeout -k 5 "$cap" "$@" >> "$OUT/all.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$OUT/summary.txt"
}
