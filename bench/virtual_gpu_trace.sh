#!/usr/bin/env bash
# Two replicas sharing one GPU, traced: chapter 5's picture of what overlaps and what does not.
#
#   bench/virtual_gpu_trace.sh [IMG_DIR]        (default docs/img)
#
# ResNet-18 (batch 512, split over the devices) on --devices cuda:0*2 -- two logical devices on
# one GPU, each with its own streams and worker thread; the ring allreduce, as NCCL refuses two
# ranks on one GPU -- with --trace: CUDA events around each stage of the first steps, per device
# and stream, drawn by bench/plot_trace.py into IMG_DIR/virtual_gpu_trace.png (the JSON beside
# it). Then the epoch time of the same global batch on one device, on the two sharing the GPU,
# and, when the machine has two GPUs, on cuda:0,cuda:1 with the ring too, from the programs' CSV
# (median of the epochs after the first). Logs in $OUT.
set -uo pipefail
set -f  # no globbing: "cuda:0*2" is a word, not a pattern
cd "$(dirname "$0")/.."
. bench/gpu_env.sh
IMG=${1:-docs/img}
mkdir -p "$IMG"
build_gpu resnet || exit 1
R=./build-gpu/examples/resnet
run() {  # NAME FLAGS...: one run, its log in $OUT/NAME.log; non-zero when it fails
  local name=$1; shift
  "$R" --data "$DATA" --batch-size 512 --no-progress "$@" > "$OUT/$name.log" 2>&1 ||
    { echo "$name: failed (exit $?)"; tail -5 "$OUT/$name.log"; return 1; }
}
run trace --devices 'cuda:0*2' --comm ring --epochs 1 --trace "$IMG/virtual_gpu_trace.json" || exit 1
python3 bench/plot_trace.py "$IMG/virtual_gpu_trace.json" "$IMG/virtual_gpu_trace.png" --skip-first \
  --title "ResNet-18, two replicas sharing one GPU (cuda:0*2, ring allreduce)" || exit 1
echo "picture: $IMG/virtual_gpu_trace.png"
median_epoch() {  # CSV: the median seconds of the epochs after the first
  python3 -c 'import csv, statistics, sys; rows = list(csv.DictReader(open(sys.argv[1])))[1:]
print(statistics.median(float(r["seconds"]) for r in rows) if rows else "none")' "$1"
}
echo "== ResNet-18, global batch 512, seconds per epoch (median of epochs 2-3)"
variants=("one:--devices cuda:0" "shared:--devices cuda:0*2 --comm ring")
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && variants+=("two:--devices cuda:0,cuda:1 --comm ring")
for v in "${variants[@]}"; do
  name=${v%%:*} flags=${v#*:}
  # shellcheck disable=SC2086  # the flags are words
  run "$name" $flags --epochs 3 --csv "$OUT/$name.csv" && printf '%-8s %-34s %s\n' "$name" "$flags" "$(median_epoch "$OUT/$name.csv")"
done
