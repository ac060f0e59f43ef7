#!/usr/bin/env bash
# One GPU, one call: a DDP rank's step replayed from a CUDA graph against the plain graphed
# step, on the programs themselves.
#
#   bench/ddp_graph_gpu.sh [--epochs N]
#
# For LeNet (the default recipe, bs 256) and ResNet-18 (channels-last, bf16, timed cuDNN
# engines): the program alone (its step in a CUDA graph), the same under tandem-run as one rank
# of an NCCL job (DDP, its step in a CUDA graph: Note [a CUDA graph per DDP rank]), and that rank
# with --no-cuda-graph. Prints the median images/s over the epochs after the first, and the
# ratio to the program alone. Logs in $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
EPOCHS=6
while [ $# -gt 0 ]; do
  case "$1" in
    --epochs) EPOCHS=$2; shift ;;
    *) echo "ddp_graph_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
build_gpu lenet resnet tandem-run || exit 1
E=./build-gpu/examples
L="$OUT/ddp_graph.log"
: > "$L"
run() {  # LABEL PROGRAM FLAGS...: one line "LABEL <images/s of each epoch>"
  local label=$1; shift
  local log="$OUT/ddp_graph_${label// /_}.log"
  "$@" > "$log" 2>&1 || { echo "$label: failed"; tail -5 "$log"; }
  echo "$label $(grep -Eo '[0-9]+ images/s' "$log" | cut -d' ' -f1 | tr '\n' ' ')" >> "$L"
  grep -h "CUDA graph off" "$log" | head -1
}
launch() { $E/tandem-run --standalone --nproc-per-node 1 "$@"; }
for model in lenet resnet; do
  flags="--data $DATA --epochs $EPOCHS --no-progress"
  [ "$model" = resnet ] && flags="$flags --channels-last --precision bf16 --epochs $((EPOCHS / 2 + 1))"
  export TANDEM_CUDNN_BENCHMARK=$([ "$model" = resnet ] && echo 1 || echo 0)
  run "$model alone" $E/$model $flags
  run "$model ddp-nccl-1 graph" launch $E/$model $flags
  run "$model ddp-nccl-1 eager" launch $E/$model $flags --no-cuda-graph
done
echo "== results ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%Y-%m-%d)," \
     "$(nvcc --version | grep -o 'release [0-9.]*'))"
python3 - "$L" <<'PY' | tee "$OUT/ddp_graph_table.txt"
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    parts = line.split()
    label, nums = " ".join(parts[:3]) if "ddp" in line else " ".join(parts[:2]), [float(x) for x in parts[(3 if "ddp" in line else 2):]]
    rows[label] = statistics.median(nums[1:]) if len(nums) > 1 else (nums[0] if nums else float("nan"))
print(f"{'run':<28} {'images/s (median, epochs 2..)':>30} {'vs alone':>9}")
for label, v in rows.items():
    base = rows.get(label.split()[0] + " alone", float("nan"))
    print(f"{label:<28} {v:>30.0f} {v / base:>9.3f}")
PY
