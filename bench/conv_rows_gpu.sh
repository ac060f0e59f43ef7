#!/usr/bin/env bash
# One GPU, one call: LeNet's convolutions pass by pass through cuDNN, the direct kernels and the
# row-window kernels (bench_conv_small; Note [row convolution] in kernels/cuda/conv_rows.cu),
# then LeNet trained with them in both cuDNN engine modes beside PyTorch's whole-step CUDA
# graph, and the kernel timeline of tandem's replayed step.
#
#   bench/conv_rows_gpu.sh [--epochs N] [--tests] [--suite] [--sanitize] [--ncu] [--quick]
#
# --tests first runs the convolution tests and the [cuda] tests; --suite runs the whole test
# suite instead; --sanitize runs the small row-kernel and direct-kernel tests ([rows],
# [direct]) under compute-sanitizer's memcheck and racecheck; --ncu profiles the row
# kernels' first launches with Nsight Compute; --quick runs only the convolution test and
# trains only with tandem's own kernels as chosen. Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
EPOCHS=5 TESTS=0 SUITE=0 SAN=0 NCU=0 QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --epochs) EPOCHS=$2; shift ;;
    --tests) TESTS=1 ;;
    --suite) SUITE=1 ;;
    --sanitize) SAN=1 ;;
    --ncu) NCU=1 ;;
    --quick) QUICK=1 ;;
    *) echo "conv_rows_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ "$SUITE" = 1 ]; then build_gpu || exit 1  # the suite runs the examples and tandem-run too
else build_gpu bench_train bench_conv_small tandem_kernel_timeline $([ "$TESTS$SAN" != 00 ] && echo tandem_tests) || exit 1; fi
B=./build-gpu
CONV='cuda conv2d forward and backward through cuDNN'
if [ "$TESTS" = 1 ]; then
  TAGS=("$CONV" "[cuda]"); [ "$QUICK" = 1 ] && TAGS=("$CONV")
  for tag in "${TAGS[@]}"; do
    $B/tests/tandem_tests "$tag" > "$OUT/tests.log" 2>&1
    echo "$tag: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests.log" | tail -1)"
    grep -B12 -A14 FAILED "$OUT/tests.log" | head -60
  done
fi
if [ "$SUITE" = 1 ]; then
  start=$(date +%s)
  TANDEM_DIST_TIMEOUT=60 timeout 300 $B/tests/tandem_tests > "$OUT/suite.log" 2>&1
  echo "whole suite (rc $?, $(( $(date +%s) - start )) s): $(grep -E '^(All tests passed|test cases:)' "$OUT/suite.log" | tail -1)"
  grep -B12 -A14 FAILED "$OUT/suite.log" | head -60
fi
if [ "$SAN" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool $B/tests/tandem_tests "[rows],[direct]" > "$OUT/san_$tool.log" 2>&1
    echo "compute-sanitizer $tool (rc $?): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|All tests passed|test cases:' "$OUT/san_$tool.log" | tr '\n' ' ')"
  done
fi
$B/bench/bench_conv_small > "$OUT/conv_small.txt" 2>&1
cat "$OUT/conv_small.txt"
if [ "$NCU" = 1 ]; then
  timeout 200 ncu --clock-control none -k regex:'row_(conv|wgrad)_kernel' --launch-count 12 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis $B/bench/bench_conv_small --runs 3 > "$OUT/ncu_rows.txt" 2>&1
  echo "ncu rc $? ($(grep -c 'row_' "$OUT/ncu_rows.txt") lines naming the row kernels)"
fi
R=$OUT/lenet.jsonl
: > "$R"
echo "== lenet, $EPOCHS epochs, graph: median s/epoch"
# Three variants: tandem's own convolution kernels as chosen (row and direct kernels), the row
# kernels off (TANDEM_ROW_CONV=-: the direct kernels and cuDNN, as before them), and every
# convolution in cuDNN (TANDEM_DIRECT_CONV=0).
VARIANTS="own rows-off cudnn"; [ "$QUICK" = 1 ] && VARIANTS=own
for bm in 1 0; do
  for v in $VARIANTS; do
    case $v in
      own) envs=() ;;
      rows-off) envs=(TANDEM_ROW_CONV=-) ;;
      cudnn) envs=(TANDEM_DIRECT_CONV=0) ;;
    esac
    line=$(env "${envs[@]}" TANDEM_CUDNN_BENCHMARK=$bm \
      $B/bench/bench_train --model lenet --data "$DATA" --devices cuda:0 --epochs "$EPOCHS" 2>> "$OUT/lenet.err" | tail -1)
    echo "$line" | sed "s/^{/{\"convolutions\": \"$v\", \"timed_engines\": $bm, /" >> "$R"
    printf 'engines %-10s convolutions %-8s %s\n' "$([ $bm = 1 ] && echo timed || echo heuristics)" "$v" \
      "$(echo "$line" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["median_s"], "s/epoch", d["peak_mb"], "MB", "acc", d.get("train_acc"))')"
  done
done
python3 bench/torch_lenet.py --data "$DATA" --epochs "$EPOCHS" --paths graph >> "$R" 2>> "$OUT/lenet.err"
echo "pytorch graph: $(tail -1 "$R" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["median_s"], 5), "s/epoch", round(d["peak_mb"], 1), "MB")')"
LIB=$PWD/build-gpu/bench/libtandem_kernel_timeline.so
rm -f "$OUT"/lenet_timeline_*.json.tmp
for bm in 0 1; do
  CUDA_INJECTION64_PATH=$LIB TANDEM_TIMELINE=$OUT/lenet_timeline_$bm.json TANDEM_CUDNN_BENCHMARK=$bm \
    $B/bench/bench_train --model lenet --data "$DATA" --devices cuda:0 --epochs 2 > "$OUT/timeline_$bm.out" 2>&1
  python3 bench/timeline_summary.py "$OUT/lenet_timeline_$bm.json" \
    --label "tandem (graph, $([ $bm = 1 ] && echo timed || echo heuristics))" \
    --json "$OUT/lenet_timeline_$bm.summary.json" > "$OUT/lenet_timeline_$bm.txt" 2>&1
  head -1 "$OUT/lenet_timeline_$bm.txt"
  rm -f "$OUT/lenet_timeline_$bm.json" "$OUT/timeline_$bm.out"  # the summary keeps what matters
done
