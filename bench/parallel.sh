#!/usr/bin/env bash
# Multi-GPU part of bench/run_gpu.sh: LeNet and ResNet-18 on 1 and N GPUs (tandem scratch,
# tandem DataParallel, PyTorch DataParallel and DDP) and allreduce bandwidth.
#   bench/parallel.sh DATA RESULTS NGPU
DATA=$1 RESULTS=$2 NGPU=$3
B=./build-gpu/bench
LIMIT=${RESNET_TRAIN_LIMIT:--1}
DEVS=$(seq -s, 0 $((NGPU - 1)) | sed 's/\([0-9]\+\)/cuda:\1/g')
echo "== resnet18 and lenet, 1 GPU"
$B/bench_train --model resnet18 --data "$DATA" --devices cuda:0 --epochs 3 --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/bench_parallel.err"
if [ "$NGPU" -ge 2 ]; then
  echo "== $NGPU GPUs: tandem"
  $B/bench_allreduce >> "$RESULTS" 2>> "$OUT/bench_parallel.err"
  for m in lenet resnet18; do
    bs=256; [ $m = resnet18 ] && bs=$((256 * NGPU))
    $B/bench_train --model $m --data "$DATA" --devices "$DEVS" --parallel scratch --comm nccl --batch-size $bs \
      --epochs 3 --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/bench_parallel.err"
    $B/bench_train --model $m --data "$DATA" --devices "$DEVS" --parallel dp --batch-size $bs \
      --epochs 3 --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/bench_parallel.err"
  done
  $B/bench_train --model resnet18 --data "$DATA" --devices "$DEVS" --parallel scratch --comm ring --batch-size $((256 * NGPU)) \
      --epochs 3 --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/bench_parallel.err"
  # The same global batch as one GPU (256): half the work per GPU, so host costs weigh more.
  $B/bench_train --model resnet18 --data "$DATA" --devices "$DEVS" --parallel scratch --comm nccl --batch-size 256 \
      --epochs 3 --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/bench_parallel.err"
  echo "== $NGPU GPUs: pytorch"
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths 1gpu,ddp --batch-size 256 --epochs 2 \
    --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/torch_parallel.err"
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths ddp --batch-size $((256 * NGPU)) --epochs 2 \
    --train-limit "$LIMIT" --allreduce >> "$RESULTS" 2>> "$OUT/torch_parallel.err"
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths 1gpu,ddp --batch-size $((256 * NGPU)) --epochs 2 \
    --train-limit "$LIMIT" --cudnn-benchmark >> "$RESULTS" 2>> "$OUT/torch_parallel.err"
  python3 bench/torch_parallel.py --data "$DATA" --models lenet --paths dp,ddp --batch-size 256 --epochs 2 \
    --train-limit "$LIMIT" >> "$RESULTS" 2>> "$OUT/torch_parallel.err"
fi
