#!/usr/bin/env bash
# Builds tandem (CUDA backend too when nvcc is found) and runs the whole test suite.
# Tests that need a GPU skip themselves on a machine without one.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
