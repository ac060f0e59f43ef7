#!/usr/bin/env bash
# Installs what is missing (Debian packages, the Fashion-MNIST data), builds tandem and
# trains LeNet on Fashion-MNIST: on a GPU if there is one, else on the CPU.
# Extra arguments go to the training program (see build/examples/lenet --help).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
pkgs="cmake g++ make libopenblas-dev zlib1g-dev catch2 libgloo-dev nlohmann-json3-dev dataset-fashion-mnist"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ] && command -v apt-get >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target lenet
./build/examples/lenet "$@"
