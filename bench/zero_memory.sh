#!/usr/bin/env bash
# Bytes per rank of ResNet-18 with Adam under DDP and --zero 1, 2, 3, on N = 1..4 CPU processes
# (Gloo) of this machine: each run takes two optimizer steps, then rank 0 prints the memory line
# (Note [the memory line] in examples/common/zero_stepper.cpp). One line per run in OUT: N, mode,
# the largest rank's peak RSS (GNU time's %M over the launcher's children), wall seconds, the
# memory line (--zero) and the epoch line. scripts/plot_zero_memory.py draws OUT.
#   bench/zero_memory.sh [OUT] [DATA]
#   (default OUT bench/results/zero_memory_cpu_<date>.txt, DATA the default Fashion-MNIST folder)
set -u
OUT=${1:-bench/results/zero_memory_cpu_$(date -u +%F).txt}
DATA=${2:-/usr/share/datasets/fashion-mnist}
B=${BUILD:-./build-cpu}/examples
# 24 images, a global batch of 12 (a multiple of every N): two steps; eight test images.
FLAGS="--data $DATA --device cpu --epochs 1 --train-limit 24 --batch-size 12 --test-limit 8 --optimizer adam --no-progress"
LOG=$(mktemp)
: > "$OUT"
echo "# bench/zero_memory.sh on $(nproc) cores, $(date -u +%FT%TZ); resnet $FLAGS" >> "$OUT"
for n in 1 2 3 4; do
  for mode in ddp zero1 zero2 zero3; do
    zero=""
    [ "$mode" != ddp ] && zero="--zero ${mode#zero}"
    start=$(date +%s.%N)
    if ! TANDEM_DIST_TIMEOUT=120 /usr/bin/time -f "%M" -o "$LOG.rss" "$B/tandem-run" --standalone --no-prefix \
        --nproc-per-node "$n" "$B/resnet" $FLAGS $zero > "$LOG" 2>&1; then
      echo "failed: N $n $mode"; tail -3 "$LOG"; continue
    fi
    wall=$(echo "$(date +%s.%N) - $start" | bc)
    line="N $n  mode $mode  max_rss_kb $(tail -1 "$LOG.rss")  wall_s $(printf %.2f "$wall")"
    mem=$(grep -m1 "^memory of rank" "$LOG")
    [ -n "$mem" ] && line="$line  $mem"
    echo "$line  $(grep -m1 '^epoch' "$LOG" | sed 's/  */ /g')" | tee -a "$OUT"
  done
done
rm -f "$LOG" "$LOG.rss"
