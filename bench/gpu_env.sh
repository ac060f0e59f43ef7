# Sourced by the GPU scripts (from the repository root): $OUT (default ./out, created) and
# $DATA (default ./.data/fashion-mnist, else the Debian path); cuDNN and NCCL from the Python
# wheels (the GPU machines have no system packages of them); NVLink multicast off; and
# build_gpu [TARGET...], which configures and builds build-gpu (all targets, or the ones named)
# with every core, output in $OUT/build.log and its tail on failure.
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
DATA=${DATA:-$PWD/.data/fashion-mnist}
[ -d "$DATA" ] || DATA=/usr/share/datasets/fashion-mnist
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared machines
if P=$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null); then
  export CUDNN_ROOT=${CUDNN_ROOT:-$P/nvidia/cudnn} NCCL_ROOT=${NCCL_ROOT:-$P/nvidia/nccl}
fi
build_gpu() {
  echo "== build" | tee "$OUT/build.log"
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >> "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" ${1:+--target "$@"} >> "$OUT/build.log" 2>&1 ||
    { tail -50 "$OUT/build.log"; return 1; }
}
