#!/usr/bin/env bash
# One GPU, one call: LeNet with the small-layer fusions on and off (Note [linear + activation]
# and Note [activation + pooling] in kernels/backend.h), in both cuDNN engine modes, beside
# PyTorch's whole-step CUDA graph; then the kernel timeline of tandem's replayed step.
#
#   bench/fusion_gpu.sh [--epochs N] [--tests]
#
# Each variant is a separate process, so in the timed-engine mode each picks its convolution
# engines anew (a source of noise between rows); the heuristics rows use the same engines.
# --tests first runs the fused ops' tests and the [cuda] tests. Logs in $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
EPOCHS=5 TESTS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --epochs) EPOCHS=$2; shift ;;
    --tests) TESTS=1 ;;
    *) echo "fusion_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
build_gpu bench_train tandem_kernel_timeline $([ "$TESTS" = 1 ] && echo tandem_tests) || exit 1
B=./build-gpu
if [ "$TESTS" = 1 ]; then
  for tag in "*linear*,*pool*" "[cuda]"; do
    $B/tests/tandem_tests "$tag" > "$OUT/tests.log" 2>&1
    echo "$tag: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests.log" | tail -1)"
    grep -B8 -A14 FAILED "$OUT/tests.log" | head -40
  done
fi
R=$OUT/fusion.jsonl
: > "$R"
echo "== lenet, $EPOCHS epochs, graph: median s/epoch"
for bm in 0 1; do
  for fuse in 1 0; do
    line=$(TANDEM_FUSE_LINEAR_ACT=$fuse TANDEM_FUSE_ACT_POOL=$fuse TANDEM_CUDNN_BENCHMARK=$bm \
      $B/bench/bench_train --model lenet --data "$DATA" --devices cuda:0 --epochs "$EPOCHS" 2>> "$OUT/fusion.err" | tail -1)
    echo "$line" | sed "s/^{/{\"fusions\": $fuse, \"timed_engines\": $bm, /" >> "$R"
    printf 'engines %-10s fusions %-3s %s\n' "$([ $bm = 1 ] && echo timed || echo heuristics)" \
      "$([ $fuse = 1 ] && echo on || echo off)" "$(echo "$line" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["median_s"], "s/epoch", d["peak_mb"], "MB")')"
  done
done
python3 bench/torch_lenet.py --data "$DATA" --epochs "$EPOCHS" --paths graph >> "$R" 2>> "$OUT/fusion.err"
echo "pytorch graph: $(tail -1 "$R" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["median_s"], 5), "s/epoch", round(d["peak_mb"], 1), "MB")')"
LIB=$PWD/build-gpu/bench/libtandem_kernel_timeline.so
CUDA_INJECTION64_PATH=$LIB TANDEM_TIMELINE=$OUT/lenet_timeline.json TANDEM_CUDNN_BENCHMARK=0 \
  $B/bench/bench_train --model lenet --data "$DATA" --devices cuda:0 --epochs 2 > "$OUT/timeline.out" 2>&1
python3 bench/timeline_summary.py "$OUT/lenet_timeline.json" --label "tandem (graph, heuristics, fused)" \
  --json "$OUT/lenet_timeline.summary.json" > "$OUT/lenet_timeline.txt" 2>&1
head -1 "$OUT/lenet_timeline.txt"
