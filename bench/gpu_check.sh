set -o pipefail; . bench/gpu_env.sh; export TANDEM_DIST_TIMEOUT=60
build_gpu tandem_tests tandem_dist_worker tandem-run lenet resnet first_program || exit 1
B=build-gpu; T=$B/tests/tandem_tests
echo "== whole suite"; timeout 300 $T > $OUT/tests.log 2>&1; echo "suite rc=$?"; grep -E "^(All tests passed|test cases:|assertions:)" $OUT/tests.log | tail -2; grep -B3 -A15 "FAILED" $OUT/tests.log | head -80
for tag in "[virtual_gpu]" "[cuda_graph]" "[syncbn]" "[cuda][dist]" "[pipeline][cuda]" "[spellings],[holder]"; do echo "== $tag: $(timeout 120 $T "$tag" 2>&1 | grep -E '^(All tests passed|test cases:|No test cases)' | tail -1)"; done
D=.data/fashion-mnist
echo "== lenet cuda:0*2 ring"; timeout 120 $B/examples/lenet --data $D --devices 'cuda:0*2' --comm ring --epochs 1 2>&1 | tail -2
echo "== lenet cuda:0*2 nccl (refusal expected)"; timeout 60 $B/examples/lenet --data $D --devices 'cuda:0*2' --comm nccl --epochs 1 2>&1 | tail -1; echo "rc=$?"
echo "== lenet pipeline cuda:0*2"; timeout 120 $B/examples/lenet --data $D --parallel pipeline --devices 'cuda:0*2' --micro-batches 4 --schedule 1f1b --epochs 1 2>&1 | tail -2
echo "== lenet alone"; timeout 120 $B/examples/lenet --data $D --epochs 2 2>&1 | tail -2
echo "== lenet --zero 1/2/3, one NCCL rank (the line of lenet alone expected)"; for z in 1 2 3; do timeout 120 $B/examples/tandem-run --standalone --nproc-per-node 1 $B/examples/lenet --data $D --epochs 2 --zero $z 2>&1 | grep -E "epoch +2|memory|rror" | head -3; done
echo "== zero/fsdp one NCCL rank"; for m in "zero --nccl --stage 2 --optim adam" "zero --nccl --stage 1 --optim sgd" "fsdp --nccl" "syncbn --nccl --sizes 8"; do timeout 60 $B/examples/tandem-run --standalone --nproc-per-node 1 $B/tests/tandem_dist_worker $m > $OUT/w.log 2>&1; echo "$m: rc=$? $(grep -hE "_vs_" $OUT/w.log | tr "\n" " ")"; done
echo "== memcheck"; SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer); timeout 240 $SAN --tool memcheck --report-api-errors no $T "[virtual_gpu],[cuda_graph],[syncbn]" > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/memcheck.log | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 bash bench/ddp_graph_gpu.sh --epochs 6 | tail -8
