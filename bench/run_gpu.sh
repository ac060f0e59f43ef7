#!/usr/bin/env bash
# One call on a GPU machine: build, run the whole test suite (GPU tests included), then time
# tandem and PyTorch side by side and print a table. Logs go to $OUT (or ./out).
#
#   bench/run_gpu.sh [--skip-tests] [--only lenet|parallel] [--accuracy]
#
# --accuracy also runs bench/accuracy.sh (full LeNet and ResNet-18 training runs, CSVs and
# timeline traces). Everything but the results and the table is packed into $OUT/logs.tgz.
#
# Needs the Fashion-MNIST .gz files in $DATA (default: ./.data/fashion-mnist, else the Debian path).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared machines
DATA=${DATA:-$PWD/.data/fashion-mnist}
[ -d "$DATA" ] || DATA=/usr/share/datasets/fashion-mnist
SKIP_TESTS=0
ONLY=all
ACCURACY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) SKIP_TESTS=1 ;;
    --only) ONLY=$2; shift ;;
    --accuracy) ACCURACY=1 ;;
  esac
  shift
done

# cuDNN and NCCL headers come with the Python wheels on these machines.
if P=$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null); then
  export CUDNN_ROOT=${CUDNN_ROOT:-$P/nvidia/cudnn} NCCL_ROOT=${NCCL_ROOT:-$P/nvidia/nccl}
fi

echo "== build" | tee "$OUT/build.log"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >> "$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j"$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }

if [ "$SKIP_TESTS" = 0 ]; then
  echo "== tests"
  ./build-gpu/tests/tandem_tests --durations yes > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E "^(All tests passed|test cases:)" "$OUT/tests.log" | tail -2
  [ $rc -eq 0 ] || { grep -B5 -A20 -E "FAILED|failed" "$OUT/tests.log" | head -120; }
  ./build-gpu/tests/tandem_tests "[cuda]" > "$OUT/tests_cuda.log" 2>&1
  echo "cuda-tagged tests: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests_cuda.log" | tail -1)"
fi

RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
NGPU=$(nvidia-smi -L | wc -l)

if [ "$ONLY" = all ] || [ "$ONLY" = lenet ]; then
  echo "== lenet"
  ./build-gpu/bench/bench_train --model lenet --data "$DATA" --devices cuda:0 --epochs 5 >> "$RESULTS" 2> "$OUT/bench_lenet.err" || tail -5 "$OUT/bench_lenet.err"
  python3 bench/torch_lenet.py --data "$DATA" --epochs 5 >> "$RESULTS" 2> "$OUT/torch_lenet.err" || tail -5 "$OUT/torch_lenet.err"
fi
if [ -x bench/parallel.sh ] && { [ "$ONLY" = all ] || [ "$ONLY" = parallel ]; }; then
  bench/parallel.sh "$DATA" "$RESULTS" "$NGPU"
fi

if [ "$ACCURACY" = 1 ]; then
  echo "== accuracy"
  bench/accuracy.sh "$DATA" 5 | tee "$OUT/accuracy.txt"
fi

echo "== results ($GPU x$NGPU, $(date -u +%Y-%m-%d), $(nvcc --version | grep -o 'release [0-9.]*'), torch $(python3 -c 'import torch;print(torch.__version__)'))"
python3 bench/table.py "$RESULTS"  | tee "$OUT/table.txt"
# Pack the logs, CSVs and traces into one file (only a few files come back from a remote run).
(cd "$OUT" && tar czf /tmp/tandem_logs.tgz --exclude=results.jsonl --exclude=table.txt . ;
  find . -maxdepth 1 -type f ! -name results.jsonl ! -name table.txt -delete; mv /tmp/tandem_logs.tgz logs.tgz)
