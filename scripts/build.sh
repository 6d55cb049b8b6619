#!/usr/bin/env bash
# Configures and builds treeverify into BUILD_DIR (default build/). Extra arguments go to CMake.
# CUDA targets compile for sm_90a only unless CMAKE_CUDA_ARCHITECTURES is given (CI's 2 cores).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90a}" -DTREEVERIFY_WERROR=ON "$@"
cmake --build "$build_dir" --parallel "${JOBS:-$(nproc)}"
