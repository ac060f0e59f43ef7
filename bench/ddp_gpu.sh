#!/usr/bin/env bash
# DistributedDataParallel on a GPU machine, in one call: build, the GPU and multi-process tests,
# then (with --bench) one-process-per-GPU training beside plain training, tandem and PyTorch,
# and a short table at the end. Logs go to $OUT (or ./out).
#
#   bench/ddp_gpu.sh [--no-examples] [--bench] [--epochs N] [--no-full-tests]
#
# Needs the Fashion-MNIST .gz files in $DATA (default: ./.data/fashion-mnist) for --bench.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
DATA=${DATA:-$PWD/.data/fashion-mnist}
EXAMPLES=ON
BENCH=0
EPOCHS=3
FULL=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-examples) EXAMPLES=OFF ;;
    --bench) BENCH=1 ;;
    --epochs) EPOCHS=$2; shift ;;
    --no-full-tests) FULL=0 ;;
  esac
  shift
done
if P=$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null); then
  export CUDNN_ROOT=${CUDNN_ROOT:-$P/nvidia/cudnn} NCCL_ROOT=${NCCL_ROOT:-$P/nvidia/nccl}
fi

echo "== build"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_EXAMPLES=$EXAMPLES -DTANDEM_BUILD_BENCH=$([ "$BENCH" = 1 ] && echo ON || echo OFF) > "$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j"$(nproc)" >> "$OUT/build.log" 2>&1 || { grep -E "error|Error" -A5 "$OUT/build.log" | head -60; exit 1; }
grep "tandem:" "$OUT/build.log"

echo "== tests"
./build-gpu/tests/tandem_tests "[cuda],[dist],[reducer]" --durations yes > "$OUT/tests_gpu_dist.log" 2>&1
rc=$?
grep -E "^(All tests passed|test cases:)" "$OUT/tests_gpu_dist.log" | tail -2
[ $rc -eq 0 ] || grep -B5 -A25 -E "FAILED" "$OUT/tests_gpu_dist.log" | head -150
grep -B1 -A2 "fewer than 2 GPUs" "$OUT/tests_gpu_dist.log" | head -8
if [ "$FULL" = 1 ]; then
  ./build-gpu/tests/tandem_tests > "$OUT/tests_all.log" 2>&1
  echo "all tests: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests_all.log" | tail -1)"
fi

[ "$BENCH" = 1 ] || exit 0
bench/ddp_bench.sh "$DATA" "$EPOCHS" "$OUT"
