#!/usr/bin/env bash
# Where one training step's time goes, tandem and PyTorch side by side on one GPU: host enqueue
# time against wall time, forward / backward split, per-kernel GPU time (ncu for tandem, the
# PyTorch profiler for PyTorch), with cuDNN's heuristics and with benchmark mode.
#   bench/profile_step.sh [--no-build] [--no-ncu] [--all]     (logs and tables under $OUT)
# --all adds cuDNN benchmark mode and exact float32 (TF32 off) to the comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
BUILD=1 NCU=1 ALL=0
for a in "$@"; do
  case "$a" in --no-build) BUILD=0 ;; --no-ncu) NCU=0 ;; --all) ALL=1 ;; esac
done
if P=$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null); then
  export CUDNN_ROOT=${CUDNN_ROOT:-$P/nvidia/cudnn} NCCL_ROOT=${NCCL_ROOT:-$P/nvidia/nccl}
fi
if [ "$BUILD" = 1 ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
B=./build-gpu/bench
R="$OUT/step.jsonl"
: > "$R"
BMS="0"; [ "$ALL" = 1 ] && BMS="0 1"
$B/bench_step --model resnet18 --host-ops > "$OUT/host_ops.jsonl" 2>> "$OUT/step.err"
TANDEM_CUDNN_LEGACY=1 $B/bench_step --model resnet18 --host-ops --steps 1 --reps 1 2>> "$OUT/step.err" |
  sed 's/"op": "conv/"op": "legacy conv/' | grep legacy >> "$OUT/host_ops.jsonl"
for m in resnet18 lenet; do
  TANDEM_CUDNN_LEGACY=1 $B/bench_step --model $m | sed 's/"tandem"/"tandem-legacy-cudnn"/' >> "$R" 2>> "$OUT/step.err"
  for bm in $BMS; do
    TANDEM_CUDNN_BENCHMARK=$bm $B/bench_step --model $m >> "$R" 2>> "$OUT/step.err"
  done
  [ "$ALL" = 1 ] && TANDEM_ALLOW_TF32=0 $B/bench_step --model $m >> "$R" 2>> "$OUT/step.err"
  python3 bench/torch_step.py --model $m --cudnn-benchmark "${BMS// /,}" --kernels "$OUT/torch_kernels_$m" \
    >> "$R" 2>> "$OUT/step.err"
done
if [ "$NCU" = 1 ] && command -v ncu > /dev/null; then
  for bm in $BMS; do
    TANDEM_CUDNN_BENCHMARK=$bm ncu --csv --clock-control none --cache-control none --profile-from-start off \
      --metrics gpu__time_duration.sum $B/bench_step --model resnet18 --reps 1 --steps 2 --profile \
      > "$OUT/ncu_resnet_bm$bm.csv" 2>> "$OUT/step.err"
    python3 bench/ncu_summary.py "$OUT/ncu_resnet_bm$bm.csv" --top 45 > "$OUT/ncu_resnet_bm$bm.txt"
  done
fi
python3 - "$R" "$OUT/host_ops.jsonl" <<'EOF'
import json, sys
print(f"{'host cost of one call (resnet stage 1)':40s} {'host_us':>8s} {'total_us':>9s}")
for l in open(sys.argv[2]):
    r = json.loads(l)
    if r.get("kind") == "host_op":
        print(f"{r['op']:40s} {r['host_us']:8.1f} {r['total_us']:9.1f}")
print(f"{'framework':20s} {'model':8s} {'tf32':>4s} {'bench':>5s} {'host_ms':>8s} {'wall_ms':>8s} {'fwd_ms':>7s} {'fwd+bwd':>8s} {'img/s':>9s}")
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"{r['framework']:20s} {r['model']:8s} {r.get('tf32', 1):4d} {r['cudnn_benchmark']:5d} {r['host_ms']:8.3f} "
          f"{r['wall_ms']:8.3f} {r['fwd_ms']:7.3f} {r['fwd_bwd_ms']:8.3f} {r['images_per_s']:9.0f}")
EOF
