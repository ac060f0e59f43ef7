#!/usr/bin/env bash
# The bubble with a core per stage: bench_pipeline (the in-process pipeline, one worker thread
# per virtual CPU device) for P = 2 and 4 stages, GPipe and 1F1B, M = 1, 2, 4, 8, 16, each
# stage 4 x (Linear(512, 512) + ReLU), OpenBLAS on one thread per stage. Two sweeps:
#   fixed batch: 256 rows cut into M micro-batches, 12 steps. An action gets cheaper as M grows,
#     but by less than 1/M (small GEMMs, fixed costs), so the formula's premise does not hold.
#   fixed rows per micro-batch: 128 rows each, batch 128 x M, 22 steps. Every action costs the
#     same whatever M: GPipe's setting, where (P - 1)/(M + P - 1) should hold. A forward of 128
#     rows through a stage takes 9 ms and its backward 16 ms on a 2-core machine that takes
#     50 ms for the whole batch's step the 16-core machine takes in 16 ms, so about 3 and 5 ms
#     there: long against a hand-off between threads (tens of microseconds).
# Each run is timed beside the same M micro-batches through one stage alone (--stages 1).
# Prints a Markdown row per run (scripts/pipeline_idle.py: M, step ms, idle per stage, the
# formula, the mean idle over the stages and its difference from the formula, the one-stage step
# ms and the step the formula predicts from it). Meant for a machine with at least 4 free cores
# (docs/11-pipelines.md); 1 to 2 minutes on 16 cores.
#
#   bench/pipeline_threads.sh [BUILD_DIR]      (default build-cpu; the timelines go to $OUT)
#
# QUICK=1: P = 2 only, M = 1, 2, 4, 4 steps (a check that it runs, on a small machine).
# STAGES="2": only those stage counts (a machine with fewer than 4 free cores), full steps.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-cpu}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
[ -x "$B/bench/bench_pipeline" ] || { echo "pipeline_threads.sh: no $B/bench/bench_pipeline (build it first)" >&2; exit 2; }
W=512 L=4 BATCH=256 ROWS=128
PS=${STAGES:-"2 4"} MS="1 2 4 8 16" STEPS_BATCH=12 STEPS_ROWS=22
if [ "${QUICK:-0}" = 1 ]; then PS=2 MS="1 2 4" STEPS_BATCH=4 STEPS_ROWS=4; fi
FIELDS="| M | step ms | idle per stage | (p-1)/(m+p-1) | mean idle | mean - formula | one stage ms | formula's step ms |"

# run P SCHEDULE M TRACE FLAG...: one bench_pipeline run, its timeline to TRACE.
run() {
  OPENBLAS_NUM_THREADS=1 "$B/bench/bench_pipeline" --stages "$1" --schedule "$2" --micro-batches "$3" \
    --width $W --layers $L --trace "$4" "${@:5}" > /dev/null
}

# sweep TITLE NAME FLAG...: the one-stage references, then a row per P, schedule and M.
sweep() {
  local title=$1 name=$2 p s m t
  shift 2
  for s in gpipe 1f1b; do
    for m in $MS; do run 1 $s $m "$OUT/pipeline_threads_${name}${s}_p1_m${m}.json" "$@"; done
  done
  for p in $PS; do
    for s in gpipe 1f1b; do
      echo "## $title, P = $p, $s: $FIELDS"
      for m in $MS; do
        t="$OUT/pipeline_threads_${name}${s}_p${p}_m${m}.json"
        run $p $s $m "$t" "$@"
        python3 scripts/pipeline_idle.py "$t" $m "$OUT/pipeline_threads_${name}${s}_p1_m${m}.json"
      done
    done
  done
}

echo "# $(nproc) cores, $(date -u +%Y-%m-%d); W $W, L $L, OPENBLAS_NUM_THREADS=1"
sweep "fixed batch $BATCH" "" --batch $BATCH --steps $STEPS_BATCH
sweep "fixed rows per micro-batch, $ROWS rows (batch $ROWS x M)" "rows${ROWS}_" \
  --micro-batch-rows $ROWS --steps $STEPS_ROWS
