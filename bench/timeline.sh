#!/usr/bin/env bash
# Kernel timelines of replayed training steps on one GPU, tandem's and PyTorch's, in one call:
# each program runs under bench/kernel_timeline.cpp (loaded by the CUDA driver), and
# bench/timeline_summary.py prints where each replay's GPU time goes, node by node.
#
#   bench/timeline.sh [lenet] [resnet18]      (both when none is named)
#
# LeNet: tandem's graph with cuDNN's heuristics and with timed engines, PyTorch's whole-step
# graph. ResNet-18: channels-last + bf16 graphs of both. Traces, summaries and a picture of one
# replayed step per program (scripts/plot_timeline.py) in $OUT/timeline.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
models=${*:-lenet resnet18}
build_gpu bench_train tandem_kernel_timeline || exit 1
LIB=$PWD/build-gpu/bench/libtandem_kernel_timeline.so
T=$OUT/timeline
mkdir -p "$T"
trace() {  # NAME LABEL COMMAND...: runs COMMAND traced, prints the summary's headline
  local name=$1 label=$2; shift 2
  CUDA_INJECTION64_PATH=$LIB TANDEM_TIMELINE=$T/$name.json "$@" > "$T/$name.out" 2>&1 ||
    { echo "$name: failed"; tail -5 "$T/$name.out"; return; }
  python3 bench/timeline_summary.py "$T/$name.json" --label "$label" --json "$T/$name.summary.json" \
    > "$T/$name.txt" 2>&1
  echo "$name: $(head -1 "$T/$name.txt")"
}
picture() {  # OUT.png TITLE NAME...: one row per traced program
  local out=$1 title=$2 files=(); shift 2
  for n in "$@"; do [ -f "$T/$n.summary.json" ] && files+=("$T/$n.summary.json"); done
  [ ${#files[@]} -gt 0 ] && python3 scripts/plot_timeline.py "$T/$out" "${files[@]}" --title "$title" ||
    echo "timeline.sh: no picture $out"
}
tandem() { ./build-gpu/bench/bench_train --data "$DATA" --devices cuda:0 --epochs 2 "$@"; }
for m in $models; do
  case $m in
    lenet)
      TANDEM_CUDNN_BENCHMARK=0 trace lenet_tandem "tandem (graph, heuristics)" tandem --model lenet
      TANDEM_CUDNN_BENCHMARK=1 trace lenet_tandem_bench "tandem (graph, timed engines)" tandem --model lenet
      trace lenet_torch "PyTorch (whole-step CUDA graph)" python3 bench/torch_lenet.py --data "$DATA" --epochs 1 \
        --paths graph
      picture lenet_timeline.png "One replayed LeNet training step" lenet_tandem_bench lenet_torch ;;
    resnet18)
      TANDEM_CUDNN_BENCHMARK=1 trace resnet_tandem "tandem (graph, channels-last, bf16, timed)" tandem \
        --model resnet18 --channels-last --precision bf16
      trace resnet_torch "PyTorch (graph, channels_last, bf16, benchmark)" python3 bench/torch_parallel.py \
        --data "$DATA" --models resnet18 --paths 1gpu --epochs 1 --cudnn-benchmark --channels-last --bf16 --cuda-graph
      picture resnet_timeline.png "One replayed ResNet-18 training step" resnet_tandem resnet_torch ;;
    *) echo "timeline.sh: unknown model $m" >&2; exit 2 ;;
  esac
done
