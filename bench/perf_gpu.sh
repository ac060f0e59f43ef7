#!/usr/bin/env bash
# One GPU, one call: tandem's step variants and PyTorch's, side by side in one table.
#
#   bench/perf_gpu.sh [--epochs N] [--tests] [--no-resnet] [--accuracy]
#
# tandem: eager (every kernel launched from the host, --no-cuda-graph) and graph (the step
# captured once in a CUDA graph and replayed), for LeNet (bs 256) and ResNet-18 (bs 256).
# PyTorch in the same call: LeNet eager and graph; ResNet-18 eager, with cudnn.benchmark.
# Medians of the timed epochs after a warm-up epoch; peak device memory where measured.
# --tests first runs the CUDA-graph and [cuda] tests; --accuracy trains to the end with and
# without the graph (LeNet 10 epochs, both recipes; ResNet-18 5 epochs, cosine) and prints the
# final test accuracies side by side. Logs in $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh  # OUT, DATA, the wheels' cuDNN/NCCL, build_gpu
EPOCHS=5 TESTS=0 RESNET=1 ACCURACY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --epochs) EPOCHS=$2; shift ;;
    --tests) TESTS=1 ;;
    --no-resnet) RESNET=0 ;;
    --accuracy) ACCURACY=1 ;;
    *) echo "perf_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
build_gpu bench_train bench_step lenet resnet || exit 1
B=./build-gpu/bench
if [ "$TESTS" = 1 ] && build_gpu tandem_tests; then
  echo "== tests"
  ./build-gpu/tests/tandem_tests "[core]" > "$OUT/tests_core.log" 2>&1
  echo "core (CUDA graphs): $(grep -E '^(All tests passed|test cases:)' "$OUT/tests_core.log" | tail -1)"
  grep -B3 -A15 -E "FAILED" "$OUT/tests_core.log" | head -60
  ./build-gpu/tests/tandem_tests "[cuda]" > "$OUT/tests_cuda.log" 2>&1
  echo "cuda-tagged: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests_cuda.log" | tail -1)"
  grep -B3 -A15 -E "FAILED" "$OUT/tests_cuda.log" | head -60
fi
R="$OUT/perf.jsonl"
: > "$R"
echo "== lenet"
# cuDNN engines: heuristics' choice, timed (benchmark mode), timed among nondeterministic ones too.
for mode in "1 0" "1 1" "0 1"; do
  read -r det bm <<< "$mode"
  for flags in "--no-cuda-graph" ""; do
    TANDEM_CUDNN_DETERMINISTIC=$det TANDEM_CUDNN_BENCHMARK=$bm $B/bench_train --model lenet --data "$DATA" --devices cuda:0 --epochs "$EPOCHS" $flags \
      >> "$R" 2>> "$OUT/perf.err" || tail -3 "$OUT/perf.err"
  done
done
python3 bench/torch_lenet.py --data "$DATA" --epochs "$EPOCHS" --paths eager,graph >> "$R" 2>> "$OUT/perf.err" ||
  tail -3 "$OUT/perf.err"
if [ "$RESNET" = 1 ]; then
  echo "== resnet18"
  for mode in "1 0" "1 1" "0 1"; do
    read -r det bm <<< "$mode"
    for flags in "--no-cuda-graph" ""; do
      TANDEM_CUDNN_DETERMINISTIC=$det TANDEM_CUDNN_BENCHMARK=$bm $B/bench_train --model resnet18 --data "$DATA" --devices cuda:0 --epochs 3 $flags \
        >> "$R" 2>> "$OUT/perf.err" || tail -3 "$OUT/perf.err"
    done
  done
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths 1gpu --epochs 3 >> "$R" 2>> "$OUT/perf.err"
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths 1gpu --epochs 3 --cudnn-benchmark \
    >> "$R" 2>> "$OUT/perf.err"
fi
if [ "$ACCURACY" = 1 ]; then
  echo "== accuracy: final test accuracy, eager (--no-cuda-graph) | graph"
  mkdir -p "$OUT/csv"
  run_both() {  # NAME PROGRAM FLAGS...
    local name=$1 prog=$2; shift 2
    for g in eager graph; do
      local flag=""; [ $g = eager ] && flag=--no-cuda-graph
      ./build-gpu/examples/$prog --data "$DATA" --no-progress --csv "$OUT/csv/$name-$g.csv" $flag "$@" \
        > "$OUT/csv/$name-$g.log" 2>&1 || tail -3 "$OUT/csv/$name-$g.log"
    done
    printf '%-28s %s | %s\n' "$name" "$(tail -1 "$OUT/csv/$name-eager.csv" | cut -d, -f4)" \
      "$(tail -1 "$OUT/csv/$name-graph.csv" | cut -d, -f4)"
  }
  run_both lenet-sigmoid lenet
  run_both lenet-relu-momentum lenet --activation relu --momentum 0.9
  run_both resnet18-cosine-5 resnet --epochs 5 --lr-schedule cosine
  (cd "$OUT" && tar czf accuracy_csv.tgz csv && rm -rf csv)
fi
echo "== results ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%Y-%m-%d)," \
     "$(nvcc --version | grep -o 'release [0-9.]*'), torch $(python3 -c 'import torch;print(torch.__version__)'))"
python3 bench/table.py "$R" | tee "$OUT/perf_table.txt"
