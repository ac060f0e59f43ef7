#!/usr/bin/env bash
# Full training runs for accuracy on a GPU machine: LeNet (both recipes) on one GPU and on all
# GPUs, and ResNet-18 on one GPU and on all GPUs. Writes CSVs under $OUT and prints the last
# epoch of each.   bench/accuracy.sh DATA [RESNET_EPOCHS]
DATA=$1 EPOCHS=${2:-5}
B=./build-gpu/examples
NGPU=$(nvidia-smi -L | wc -l)
DEVS=$(seq -s, 0 $((NGPU - 1)) | sed 's/\([0-9]\+\)/cuda:\1/g')
run() {  # name, program args...
  local name=$1; shift
  "$@" --data "$DATA" --no-progress --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
  echo "$name: $(tail -1 "$OUT/$name.log")"
}
run lenet_sigmoid_1gpu $B/lenet --device cuda:0 --epochs 10
run lenet_relu_1gpu $B/lenet --device cuda:0 --epochs 10 --activation relu --momentum 0.9
if [ "$NGPU" -ge 2 ]; then
  run lenet_sigmoid_${NGPU}gpu_scratch $B/lenet --devices "$DEVS" --epochs 10
  run lenet_relu_${NGPU}gpu_dp $B/lenet --devices "$DEVS" --parallel dp --epochs 10 --activation relu --momentum 0.9
  run lenet_sigmoid_${NGPU}gpu_trace $B/lenet --devices "$DEVS" --epochs 1 --trace "$OUT/lenet_trace.json"
  run resnet_${NGPU}gpu_trace $B/resnet --devices "$DEVS" --batch-size 512 --epochs 1 --train-limit 5120 --trace "$OUT/resnet_trace.json"
fi
# Cosine learning-rate decay: at a constant lr 0.05 the last epoch's test accuracy swings by a few
# points from epoch to epoch, too much to compare two runs by.
for s in 0 1; do
  run resnet_1gpu_seed$s $B/resnet --device cuda:0 --epochs "$EPOCHS" --batch-size 256 --lr-schedule cosine --seed $s
  [ "$NGPU" -ge 2 ] && run resnet_${NGPU}gpu_seed$s $B/resnet --devices "$DEVS" --epochs "$EPOCHS" --batch-size 256 \
    --lr-schedule cosine --seed $s
done
