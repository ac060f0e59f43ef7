#!/usr/bin/env bash
# The sanitizer pass: builds tandem with clang under AddressSanitizer + UndefinedBehaviorSanitizer
# (-DTANDEM_SANITIZE=address,undefined, CPU only), runs the whole CPU test suite in that build,
# then runs each libFuzzer target of tests/fuzz for a bounded time starting from its seed corpus.
# Any sanitizer report, leak or fuzz finding fails the script. See docs/10-testing.md.
#
#   scripts/sanitize.sh                       everything (needs clang-16 and libclang-rt-16-dev, which
#                                             .ci/run installs: Debian's default clang 14 cannot
#                                             capture structured bindings in lambdas, which C++20
#                                             allows and the tests do)
#   FUZZ_SECONDS=300 scripts/sanitize.sh      fuzz longer (default 45 s per target)
#   SKIP_TESTS=1 scripts/sanitize.sh          only build and fuzz
#   BUILD=dir JOBS=n CXX=clang++-19           build folder (default build-sanitize), parallelism, compiler
#
# A fuzz finding leaves the input that caused it as $BUILD/fuzz-findings/<target>-crash-<sha1>;
# replay it with  $BUILD/tests/fuzz/fuzz_<target> <that file>.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${BUILD:-build-sanitize}
JOBS=${JOBS:-$(nproc)}
FUZZ_SECONDS=${FUZZ_SECONDS:-45}
CXX=${CXX:-$(command -v clang++-16 || echo clang++)}
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# -O1: what the sanitizers' authors recommend (reports keep their frames, builds are quick);
# no NDEBUG, so assert()s are checked too.
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O1 \
  -DCMAKE_CXX_COMPILER="$CXX" -DTANDEM_CUDA=OFF -DTANDEM_SANITIZE=address,undefined \
  -DTANDEM_FUZZ=ON -DTANDEM_BUILD_BENCH=OFF "${launcher[@]}" > /dev/null
cmake --build "$BUILD" -j"$JOBS"
echo "sanitize: built in $(elapsed)"

# Every report is fatal (the build adds -fno-sanitize-recover=all for UBSan); leaks are checked
# at exit. tests/sanitize/lsan.supp says why each suppression is there.
export ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=0:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$ROOT/tests/sanitize/lsan.supp:print_suppressions=0
# OpenBLAS's thread pool adds nothing to what the tests check and makes the run slower under ASan.
export OPENBLAS_NUM_THREADS=1

if [ -z "${SKIP_TESTS:-}" ]; then
  # Left out: the install test (package.*). It builds a consumer project against the installed
  # library with its own flags, and a sanitized static library only links into a program that
  # links the sanitizer runtimes too; the normal build (scripts/test.sh) runs it.
  ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" --timeout 900 -E '^package\.'
  echo "sanitize: tests passed at $(elapsed)"
fi

# Fuzzing: a scratch copy of each corpus receives the new inputs (the committed seeds stay as
# they are). -malloc_limit_mb makes any single allocation above it a finding: no input of at
# most -max_len bytes may make a parser allocate more than that, whatever its header claims.
findings=$BUILD/fuzz-findings
mkdir -p "$findings"
status=0
for target in idx_raw idx_gzip safetensors; do
  work=$(mktemp -d)
  cp "tests/fuzz/corpus/$target/"* "$work/"
  log=$BUILD/fuzz-$target.log
  if "$BUILD/tests/fuzz/fuzz_$target" -max_total_time="$FUZZ_SECONDS" -max_len=8192 \
       -malloc_limit_mb=64 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
       -artifact_prefix="$findings/$target-" "$work" > "$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "sanitize: fuzz_$target: ${runs:-?} inputs in ${FUZZ_SECONDS} s, no finding"
  else
    status=1
    echo "sanitize: fuzz_$target: FINDING (log $log, inputs in $findings):"
    grep -E "ERROR|SUMMARY|fuzz finding|runtime error" "$log" | head -20 || tail -40 "$log"
  fi
  rm -rf "$work"
done
echo "sanitize: done in $(elapsed)"
exit $status
