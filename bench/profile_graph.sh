#!/usr/bin/env bash
# Per-kernel GPU time of the training step that the example programs replay from a CUDA graph,
# on one GPU: Nsight Compute profiles each kernel node of one replayed step (after a warm-up
# of the given number of kernel launches), and the step's kernels are printed in order and
# summed by name.
#
#   bench/profile_graph.sh MODEL SKIP COUNT [bench_train flags...]
#     MODEL  lenet | resnet18;  SKIP  kernel launches to skip (warm-up and capture)
#     COUNT  kernels to profile (a little more than one step)
# Environment settings (TANDEM_CUDNN_BENCHMARK=1 ...) pass through. Needs build-gpu built.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
model=$1 skip=$2 count=$3
shift 3
tag=${TAG:-$model}
ncu --csv --clock-control none --cache-control none --launch-skip "$skip" --launch-count "$count" \
  --metrics gpu__time_duration.sum ./build-gpu/bench/bench_train --model "$model" --data "$DATA" \
  --devices cuda:0 --epochs 2 "$@" > "$OUT/ncu_graph_$tag.csv" 2> "$OUT/ncu_graph_$tag.err"
python3 bench/ncu_summary.py "$OUT/ncu_graph_$tag.csv" --top 30 --order > "$OUT/ncu_graph_$tag.txt"
cat "$OUT/ncu_graph_$tag.txt"
