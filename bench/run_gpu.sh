#!/usr/bin/env bash
# One call on a GPU machine: build, run the whole test suite (GPU tests included), then time
# tandem and PyTorch side by side and print a table. Logs go to $OUT (or ./out).
#
#   bench/run_gpu.sh [--skip-tests] [--no-compute-sanitizer] [--only lenet|parallel|sanitizer] [--accuracy]
#
# After the tests, compute-sanitizer's memcheck (out-of-bounds and misaligned device accesses,
# CUDA API errors) and racecheck (shared-memory hazards) run over the one-process [cuda] tests,
# each bounded by SANITIZER_TIMEOUT seconds (default 900), with one summary line per tool;
# --no-compute-sanitizer (or --skip-tests) leaves them out; --only sanitizer runs the build and
# this step alone. A tool that finds something, times
# out or cannot run makes the script exit non-zero at the end, after the benchmarks.
#
# --accuracy also runs bench/accuracy.sh (full LeNet and ResNet-18 training runs, CSVs and
# timeline traces). Everything but the results and the table is packed into $OUT/logs.tgz.
#
# Needs the Fashion-MNIST .gz files in $DATA (default: ./.data/fashion-mnist, else the Debian path).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh  # OUT, DATA, the wheels' cuDNN/NCCL, build_gpu
SKIP_TESTS=0
COMPUTE_SANITIZER=1
ONLY=all
ACCURACY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-tests) SKIP_TESTS=1 ;;
    --no-compute-sanitizer) COMPUTE_SANITIZER=0 ;;
    --only) ONLY=$2; shift ;;
    --accuracy) ACCURACY=1 ;;
  esac
  shift
done

build_gpu || exit 1

if [ "$SKIP_TESTS" = 0 ] && [ "$ONLY" != sanitizer ]; then
  echo "== tests"
  ./build-gpu/tests/tandem_tests --durations yes > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E "^(All tests passed|test cases:)" "$OUT/tests.log" | tail -2
  [ $rc -eq 0 ] || { grep -B5 -A20 -E "FAILED|failed" "$OUT/tests.log" | head -120; }
  ./build-gpu/tests/tandem_tests "[cuda]" > "$OUT/tests_cuda.log" 2>&1
  echo "cuda-tagged tests: $(grep -E '^(All tests passed|test cases:)' "$OUT/tests_cuda.log" | tail -1)"
fi

# compute-sanitizer over the [cuda] tests of one process ([dist] ones start other processes and
# wait on them with timeouts that the sanitizer's slowdown would break). --error-exitcode makes a
# finding visible in the exit status as well as in the summary line the tool prints last
# ("ERROR SUMMARY: n errors" for memcheck, "RACECHECK SUMMARY: n hazards displayed (e errors,
# w warnings)" for racecheck). Leak checking stays off: the stream-ordered pools keep their
# memory until exit by design. So does the report of CUDA API errors (--report-api-errors no):
# the tests provoke some on purpose (an invalid device ordinal, a host sync during a graph
# capture, measured: 5 such reports), and tandem's check macros already turn every API error
# into an exception that a test sees; what memcheck adds is the device-side access checks.
SANITIZER_STATUS=0
if [ "$SKIP_TESTS" = 0 ] && [ "$COMPUTE_SANITIZER" = 1 ]; then
  echo "== compute-sanitizer"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    log="$OUT/sanitizer_$tool.log"
    if [ ! -x "$SAN" ]; then
      echo "compute-sanitizer $tool: NOT RUN (compute-sanitizer not found)"; SANITIZER_STATUS=1; continue
    fi
    timeout "${SANITIZER_TIMEOUT:-900}" "$SAN" --tool "$tool" --error-exitcode 86 --print-limit 20 \
      $([ "$tool" = memcheck ] && echo --report-api-errors no) \
      ./build-gpu/tests/tandem_tests "[cuda]~[dist]" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
    tests=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
    case $rc in
      0) echo "compute-sanitizer $tool: clean (${summary:-no summary}; ${tests:-?})" ;;
      86) echo "compute-sanitizer $tool: FOUND ERRORS (${summary:-see $log})"; SANITIZER_STATUS=1
          grep -m 20 -E "^========= (Invalid|Error|Race|Warning|Program hit|Saved host)" "$log" ;;
      124) echo "compute-sanitizer $tool: TIMED OUT after ${SANITIZER_TIMEOUT:-900} s (log $log)"; SANITIZER_STATUS=1 ;;
      *) echo "compute-sanitizer $tool: tests FAILED under the tool (exit $rc; ${summary:-no summary}; ${tests:-?})"
         SANITIZER_STATUS=1; tail -20 "$log" ;;
    esac
  done
fi
if [ "$ONLY" = sanitizer ]; then exit "$SANITIZER_STATUS"; fi

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
[ "$SANITIZER_STATUS" = 0 ] || { echo "compute-sanitizer found problems (see above)"; exit 1; }
