#!/usr/bin/env bash
# ResNet-18 test accuracy on one GPU and on all GPUs (same global batch) for several seeds:
# how far apart 1 and N devices end up, against how far apart two seeds end up.
#   bench/resnet_seeds.sh DATA [EPOCHS] [SEEDS] [more resnet flags]   (CSVs and logs under $OUT)
DATA=$1 EPOCHS=${2:-5} SEEDS=${3:-"0 1 2"}
shift 3 2> /dev/null || shift $#
B=./build-gpu/examples
OUT=${OUT:-$PWD/out}
NGPU=$(nvidia-smi -L | wc -l)
DEVS=$(seq -s, 0 $((NGPU - 1)) | sed 's/\([0-9]\+\)/cuda:\1/g')
for s in $SEEDS; do
  for d in cuda:0 "$DEVS"; do
    name=resnet${TAG:-}_seed${s}_$(echo "$d" | tr -cd ',' | wc -c | awk '{print $1 + 1}')gpu
    $B/resnet --devices "$d" --epochs "$EPOCHS" --batch-size 256 --seed "$s" --data "$DATA" --no-progress "$@" \
      --csv "$OUT/$name.csv" > "$OUT/$name.log" 2>&1
    echo "$name: $(tail -1 "$OUT/$name.log")"
  done
done
