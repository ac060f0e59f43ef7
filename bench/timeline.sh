#!/usr/bin/env bash
# Kernel timelines of replayed training steps on one GPU, tandem's and PyTorch's, in one call:
# each program runs under bench/kernel_timeline.cpp (loaded by the CUDA driver), and
# bench/timeline_summary.py prints where each replay's GPU time goes, node by node.
#
#   bench/timeline.sh [lenet] [resnet18]      (both when none is named)
#
# LeNet: tandem's graph with cuDNN's heuristics and with timed engines, PyTorch's whole-step
# graph. ResNet-18: channels-last + bf16 graphs of both. Traces and summaries in $OUT/timeline.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
models=${*:-lenet resnet18}
build_gpu bench_train tandem_kernel_timeline || exit 1
LIB=$PWD/build-gpu/bench/libtandem_kernel_timeline.so
T=$OUT/timeline
mkdir -p "$T"
trace() {  # LABEL COMMAND...: runs COMMAND traced, prints the summary's headline
  local label=$1; shift
  CUDA_INJECTION64_PATH=$LIB TANDEM_TIMELINE=$T/$label.json "$@" > "$T/$label.out" 2>&1 ||
    { echo "$label: failed"; tail -5 "$T/$label.out"; return; }
  python3 bench/timeline_summary.py "$T/$label.json" --label "$label" --json "$T/$label.summary.json" \
    > "$T/$label.txt" 2>&1
  head -1 "$T/$label.txt"
}
tandem() { ./build-gpu/bench/bench_train --data "$DATA" --devices cuda:0 --epochs 2 "$@"; }
for m in $models; do
  case $m in
    lenet)
      TANDEM_CUDNN_BENCHMARK=0 trace lenet_tandem tandem --model lenet
      TANDEM_CUDNN_BENCHMARK=1 trace lenet_tandem_bench tandem --model lenet
      trace lenet_torch python3 bench/torch_lenet.py --data "$DATA" --epochs 1 --paths graph ;;
    resnet18)
      TANDEM_CUDNN_BENCHMARK=1 trace resnet_tandem tandem --model resnet18 --channels-last --precision bf16
      trace resnet_torch python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths 1gpu --epochs 1 \
        --cudnn-benchmark --channels-last --bf16 --cuda-graph ;;
    *) echo "timeline.sh: unknown model $m" >&2; exit 2 ;;
  esac
done
