#!/usr/bin/env bash
# The bubble with a core per stage: bench_pipeline (the in-process pipeline, one worker thread
# per virtual CPU device) for P = 2 and 4 stages, GPipe and 1F1B, M = 1, 2, 4, 8, 16, each
# stage 4 x (Linear(512, 512) + ReLU), batch 256, OpenBLAS on one thread per stage. Prints a
# Markdown row per run (scripts/pipeline_idle.py: M, step ms, idle per stage, the formula).
# Meant for a machine with at least 4 free cores (docs/11-pipelines.md).
#
#   bench/pipeline_threads.sh [BUILD_DIR]      (default build-cpu; the timelines go to $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-cpu}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
[ -x "$B/bench/bench_pipeline" ] || { echo "pipeline_threads.sh: no $B/bench/bench_pipeline (build it first)" >&2; exit 2; }
echo "# $(nproc) cores, $(date -u +%Y-%m-%d); batch 256, W 512, L 4, OPENBLAS_NUM_THREADS=1"
for p in 2 4; do
  for s in gpipe 1f1b; do
    echo "## P = $p, $s: | M | step ms | idle per stage | (p-1)/(m+p-1) |"
    for m in 1 2 4 8 16; do
      t="$OUT/pipeline_threads_${s}_p${p}_m${m}.json"
      OPENBLAS_NUM_THREADS=1 "$B/bench/bench_pipeline" --stages $p --schedule $s --micro-batches $m \
        --steps 12 --trace "$t" > /dev/null
      python3 scripts/pipeline_idle.py "$t" $m
    done
  done
done
