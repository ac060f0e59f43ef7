#!/usr/bin/env bash
# One GPU, one call: which of cuDNN's fused convolution + batch-norm graphs have an engine for
# ResNet-18's layers, what they cost against tandem's separate passes, and whether they agree.
#
#   bench/conv_bn_gpu.sh [--tests] [--runs R]
#
# --tests first runs the [cuda] tests (the convolution plans are built from the same pieces as
# the fused graphs). tandem's convolutions use timed engines (TANDEM_CUDNN_BENCHMARK=1), as the
# ResNet-18 recipe does; each fused graph is timed on up to 8 of cuDNN's engines and the fastest
# kept. Table in $OUT/conv_bn.txt (default ./out), errors in $OUT/conv_bn.err.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
TESTS=0 RUNS=30
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=1 ;;
    --runs) RUNS=$2; shift ;;
    *) echo "conv_bn_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
targets="bench_conv_bn"
[ "$TESTS" = 1 ] && targets="$targets tandem_tests"
build_gpu $targets || exit 1
if [ "$TESTS" = 1 ]; then
  ./build-gpu/tests/tandem_tests "[cuda]" > "$OUT/tests.log" 2>&1
  echo "[cuda] tests: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests.log" | tail -1)"
  grep -B3 -A15 -E "FAILED" "$OUT/tests.log" | head -60
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
TANDEM_CUDNN_BENCHMARK=1 ./build-gpu/bench/bench_conv_bn --runs "$RUNS" > "$OUT/conv_bn.txt" 2> "$OUT/conv_bn.err"
echo "bench_conv_bn exit $?"
cat "$OUT/conv_bn.txt"
head -c 3000 "$OUT/conv_bn.err"
