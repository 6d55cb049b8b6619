#!/usr/bin/env bash
# Configures and builds treeverify into BUILD_DIR (default build/). Extra arguments go to CMake.
# CUDA targets compile for sm_90a only unless CMAKE_CUDA_ARCHITECTURES is given (CI's 2 cores).
# SOURCE_DIR builds another checkout (default: this one); TARGETS (space-separated) builds only
# those targets.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source_dir=${SOURCE_DIR:-$root}
build_dir=${BUILD_DIR:-$source_dir/build}
cmake -S "$source_dir" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90a}" -DTREEVERIFY_WERROR=ON "$@"
targets=()
for target in ${TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build_dir" "${targets[@]}" --parallel "${JOBS:-$(nproc)}"
