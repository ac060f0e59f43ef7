#!/usr/bin/env bash
# One GPU, one call: tandem's step variants and PyTorch's, side by side in one table.
#
#   bench/perf_gpu.sh [--epochs N] [--tests] [--no-resnet] [--accuracy]
#
# tandem: eager (every kernel launched from the host, --no-cuda-graph) and graph (the step
# captured once in a CUDA graph and replayed), with cuDNN's heuristics or timed engines
# (benchmark mode), for LeNet (bs 256) and ResNet-18 (bs 256); for ResNet-18 also channels-last
# activations (--channels-last) and bfloat16 autocast (--precision bf16).
# PyTorch in the same call: LeNet eager and graph; ResNet-18 eager, cudnn.benchmark (eager and
# captured in a CUDA graph), and cudnn.benchmark with channels_last + bf16 autocast, eager,
# captured in a CUDA graph and under torch.compile. Medians of the timed epochs after a warm-up epoch; peak device memory of each.
# --tests first runs the [core], [cuda], [memory_format] and [bf16] tests; --accuracy trains to
# the end (LeNet 10 epochs, both recipes; ResNet-18 5 epochs, cosine) eager, graphed, and
# graphed in bfloat16 (ResNet-18 channels-last too), and prints the final test accuracies side
# by side. Logs in $OUT (default ./out).
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
  for tag in "[core]" "[cuda]" "[memory_format],[bf16]"; do
    ./build-gpu/tests/tandem_tests "$tag" > "$OUT/tests.log" 2>&1
    echo "$tag: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests.log" | tail -1)"
    grep -B3 -A15 -E "FAILED" "$OUT/tests.log" | head -60
  done
fi
R="$OUT/perf.jsonl"
: > "$R"
tandem() {  # BENCHMARK_MODE MODEL EPOCHS FLAGS...
  local bm=$1 model=$2 epochs=$3; shift 3
  TANDEM_CUDNN_BENCHMARK=$bm $B/bench_train --model "$model" --data "$DATA" --devices cuda:0 --epochs "$epochs" "$@" \
    >> "$R" 2>> "$OUT/perf.err" || tail -3 "$OUT/perf.err"
}
torch_resnet() {  # FLAGS...
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths 1gpu --epochs 3 "$@" >> "$R" 2>> "$OUT/perf.err" ||
    tail -3 "$OUT/perf.err"
}
echo "== lenet"
# cuDNN engines: heuristics' choice, and timed (benchmark mode); bfloat16 autocast.
for bm in 0 1; do
  tandem $bm lenet "$EPOCHS" --no-cuda-graph
  tandem $bm lenet "$EPOCHS"
done
tandem 1 lenet "$EPOCHS" --precision bf16
python3 bench/torch_lenet.py --data "$DATA" --epochs "$EPOCHS" --paths eager,graph >> "$R" 2>> "$OUT/perf.err" ||
  tail -3 "$OUT/perf.err"
if [ "$RESNET" = 1 ]; then
  echo "== resnet18"
  tandem 0 resnet18 3
  for flags in "" "--channels-last" "--channels-last --precision bf16"; do
    tandem 1 resnet18 3 --no-cuda-graph $flags
    tandem 1 resnet18 3 $flags
  done
  tandem 0 resnet18 3 --channels-last --precision bf16
  TANDEM_FUSE_BN_RELU=0 TANDEM_FUSE_CONV_BIAS=0 TANDEM_FUSE_BN_ADD_RELU=0 tandem 1 resnet18 3 --channels-last --precision bf16  # the batch-norm fusions off
  torch_resnet
  torch_resnet --cudnn-benchmark
  torch_resnet --cudnn-benchmark --cuda-graph
  torch_resnet --cudnn-benchmark --channels-last --bf16
  torch_resnet --cudnn-benchmark --channels-last --bf16 --cuda-graph
  torch_resnet --cudnn-benchmark --channels-last --bf16 --compile
fi
if [ "$ACCURACY" = 1 ]; then
  echo "== accuracy: final test accuracy, eager fp32 (--no-cuda-graph) | graph fp32 | graph bf16 (ResNet: channels-last)"
  mkdir -p "$OUT/csv"
  acc() {  # NAME VARIANT PROGRAM FLAGS...: trains, prints nothing, leaves the CSV
    local name=$1 v=$2 prog=$3; shift 3
    ./build-gpu/examples/$prog --data "$DATA" --no-progress --csv "$OUT/csv/$name-$v.csv" "$@" \
      > "$OUT/csv/$name-$v.log" 2>&1 || tail -3 "$OUT/csv/$name-$v.log"
  }
  last_acc() { tail -1 "$OUT/csv/$1.csv" | cut -d, -f4; }
  run_three() {  # NAME PROGRAM BF16_FLAGS FLAGS...
    local name=$1 prog=$2 bf=$3; shift 3
    acc "$name" eager "$prog" --no-cuda-graph "$@"
    acc "$name" graph "$prog" "$@"
    acc "$name" bf16 "$prog" --precision bf16 $bf "$@"
    printf '%-28s %s | %s | %s\n' "$name" "$(last_acc "$name-eager")" "$(last_acc "$name-graph")" "$(last_acc "$name-bf16")"
  }
  run_three lenet-sigmoid lenet ""
  run_three lenet-relu-momentum lenet "" --activation relu --momentum 0.9
  run_three resnet18-cosine-5 resnet --channels-last --epochs 5 --lr-schedule cosine
  (cd "$OUT" && tar czf accuracy_csv.tgz csv && rm -rf csv)
fi
echo "== results ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%Y-%m-%d)," \
     "$(nvcc --version | grep -o 'release [0-9.]*'), torch $(python3 -c 'import torch;print(torch.__version__)'))"
python3 bench/table.py "$R" | tee "$OUT/perf_table.txt"
