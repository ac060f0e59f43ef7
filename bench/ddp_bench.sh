#!/usr/bin/env bash
# The DDP part of bench/ddp_gpu.sh: on each GPU count of this machine, plain training beside
# one process per GPU (DistributedDataParallel over NCCL), tandem and PyTorch in the same call,
# then that tandem programs start under torchrun and mpirun unchanged. One JSON line per
# measurement in $OUT/ddp_results.jsonl, the table at the end.
#   bench/ddp_bench.sh DATA EPOCHS OUT
DATA=$1 EPOCHS=$2 OUT=$3
B=./build-gpu/bench
RUN=./build-gpu/examples/tandem-run
RESULTS="$OUT/ddp_results.jsonl"
: > "$RESULTS"
NGPU=$(nvidia-smi -L | wc -l)
ERR="$OUT/ddp_bench.err"
train() { "$@" >> "$RESULTS" 2>> "$ERR" || { echo "failed: $*"; tail -3 "$ERR"; }; }

echo "== ResNet-18 and LeNet: one process vs DDP with one process per GPU (twice, alternating)"
for rep in 1 2; do
  for m in resnet18 lenet; do
    train $B/bench_train --model $m --data "$DATA" --devices cuda:0 --epochs "$EPOCHS"
    train $RUN --standalone --nproc-per-node 1 --no-prefix $B/bench_train --model $m --data "$DATA" --epochs "$EPOCHS"
  done
done
train $RUN --standalone --nproc-per-node 1 --no-prefix $B/bench_train --model resnet18 --data "$DATA" --epochs "$EPOCHS" --no-overlap
if [ "$NGPU" -ge 2 ]; then
  echo "== $NGPU GPUs: allreduce through the process group, bucket sizes, a killed rank"
  $RUN --standalone --nproc-per-node "$NGPU" --no-prefix $B/bench_pg_allreduce >> "$RESULTS" 2>> "$ERR"
  python3 bench/torch_parallel.py --data "$DATA" --models resnet18 --paths ddp --epochs 2 --train-limit 2560 --allreduce \
    | grep allreduce >> "$RESULTS" 2>> "$OUT/torch_ddp.err"
  for cap in 1 5 25 100 1000; do
    train $RUN --standalone --nproc-per-node "$NGPU" --no-prefix $B/bench_train --model resnet18 --data "$DATA" \
      --epochs "$EPOCHS" --batch-size $((256 * NGPU)) --bucket-cap-mb $cap
  done
  train $RUN --standalone --nproc-per-node "$NGPU" --no-prefix $B/bench_train --model resnet18 --data "$DATA" \
    --epochs "$EPOCHS" --batch-size $((256 * NGPU)) --no-overlap
  s=$(date +%s%N)
  TANDEM_DIST_TIMEOUT=30 $RUN --standalone --nproc-per-node "$NGPU" --grace-seconds 2 ./build-gpu/tests/tandem_dist_worker \
    kill --nccl --kill-rank 1 --kill-step 20 > "$OUT/kill_nccl.log" 2>&1
  echo "killed rank under NCCL: tandem-run exit $? after $((($(date +%s%N) - s) / 1000000)) ms"; grep -E "error|tandem-run" "$OUT/kill_nccl.log" | head -4
  $RUN --standalone --nproc-per-node "$NGPU" --no-prefix ./build-gpu/examples/resnet --data "$DATA" --epochs 1 \
    --train-limit 10240 --batch-size $((256 * NGPU)) --no-progress --trace "$OUT/ddp_resnet_trace_${NGPU}gpu.json" > /dev/null 2>&1
  $RUN --standalone --nproc-per-node "$NGPU" --no-prefix ./build-gpu/examples/resnet --data "$DATA" --epochs 1 \
    --train-limit 10240 --batch-size $((256 * NGPU)) --no-progress --no-overlap --trace "$OUT/ddp_resnet_trace_${NGPU}gpu_no_overlap.json" > /dev/null 2>&1
  for m in resnet18 lenet; do
    for bs in 256 512; do
      [ $m = resnet18 ] && [ $bs = 256 ] && bs=$((256 * NGPU))
      train $RUN --standalone --nproc-per-node "$NGPU" --no-prefix $B/bench_train --model $m --data "$DATA" --epochs "$EPOCHS" --batch-size $bs
    done
  done
fi
echo "== timeline of ResNet-18 DDP steps (bucket allreduces on the comm track)"
$RUN --standalone --nproc-per-node "$NGPU" --no-prefix ./build-gpu/examples/resnet --data "$DATA" --epochs 1 \
  --train-limit 5120 --no-progress --trace "$OUT/ddp_resnet_trace.json" > "$OUT/trace_run.log" 2>&1 || tail -5 "$OUT/trace_run.log"
echo "== PyTorch: eager and DDP on the same GPUs"
python3 bench/torch_parallel.py --data "$DATA" --models resnet18,lenet --paths 1gpu,ddp --batch-size 256 \
  --epochs "$EPOCHS" >> "$RESULTS" 2>> "$OUT/torch_ddp.err" || tail -5 "$OUT/torch_ddp.err"

echo "== launchers: torchrun and mpirun start tandem programs unchanged"
L="./build-gpu/examples/lenet --data $DATA --epochs 1 --train-limit 10240 --no-progress"
if command -v torchrun > /dev/null; then
  torchrun --no-python --standalone --nproc-per-node 1 $L > "$OUT/torchrun.log" 2>&1; echo "torchrun: exit $? | $(grep -m1 epoch "$OUT/torchrun.log")"
  grep -q epoch "$OUT/torchrun.log" || tail -8 "$OUT/torchrun.log"
fi
if command -v mpirun > /dev/null; then
  mpirun --allow-run-as-root -np 1 -x MASTER_PORT=29533 $L > "$OUT/mpirun.log" 2>&1; echo "mpirun: exit $? | $(grep -m1 epoch "$OUT/mpirun.log")"
fi

echo "== results ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU, $(date -u +%Y-%m-%d), $(nvcc --version | grep -o 'release [0-9.]*'), torch $(python3 -c 'import torch;print(torch.__version__)'))"
python3 bench/table.py "$RESULTS" | tee "$OUT/ddp_table.txt"
# Only a few files come back from a remote run: pack the logs.
(cd "$OUT" && tar czf /tmp/ddp_logs.tgz --exclude=ddp_results.jsonl --exclude=ddp_table.txt --exclude='ddp_resnet_trace*.json' . &&
  find . -maxdepth 1 -type f ! -name ddp_results.jsonl ! -name ddp_table.txt ! -name 'ddp_resnet_trace*.json' -delete &&
  mv /tmp/ddp_logs.tgz logs.tgz)
