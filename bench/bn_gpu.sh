#!/usr/bin/env bash
# ResNet-18's batch-norm passes on one GPU, each against a copy of the same bytes
# (bench/bench_bn.cpp), and with --ncu, Nsight Compute's view of every kernel of those passes:
# time, DRAM throughput against the peak, bytes read and written, L2 hit rate, achieved
# occupancy, registers, blocks, and the average stall on memory per issued instruction.
#
#   bench/bn_gpu.sh [--ncu] [--batch N]          (output in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
NCU=0 ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ncu) NCU=1 ;;
    --batch) ARGS+=(--batch "$2"); shift ;;
    *) echo "bn_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
build_gpu bench_bn || exit 1
./build-gpu/bench/bench_bn "${ARGS[@]}" | tee "$OUT/bench_bn.txt" || exit 1
if [ "$NCU" = 1 ]; then
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum
  M=$M,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
  M=$M,launch__grid_size,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  ncu --csv --profile-from-start off --metrics "$M" ./build-gpu/bench/bench_bn --profile --runs 3 "${ARGS[@]}" \
    > "$OUT/bn_ncu.csv" 2> "$OUT/bn_ncu.err" || { tail -5 "$OUT/bn_ncu.err"; exit 1; }
  python3 bench/ncu_metrics.py "$OUT/bn_ncu.csv" | tee "$OUT/bn_ncu.txt"
fi
