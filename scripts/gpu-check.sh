#!/usr/bin/env bash
# GPU checks, in two halves, because the GPU machine has CUDA but none of our Debian libraries:
#
#   scripts/gpu-check.sh bundle        here: builds the GPU tests (sm_90a) and copies them with
#                                      their libraries into .gpu-bundle/ (git-ignored)
#   scripts/gpu-check.sh run [OUTDIR]  on the GPU machine, from the repository root: runs every
#                                      bundled test; a skipped test counts as a failure there
#
# With the device tool: carry .gpu-bundle and run `bash scripts/gpu-check.sh run $OUT`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=$root/.gpu-bundle
gpu_tests=(tests/kernels/cuda_rms_norm_test)

case "${1:-}" in
  bundle)
    BUILD_DIR=${BUILD_DIR:-$root/build-gpu} CUDA_ARCHS=${CUDA_ARCHS:-90a} \
      "$root/scripts/build.sh" -DTREEVERIFY_CUDA=ON
    rm -rf "$bundle"
    binaries=()
    for t in "${gpu_tests[@]}"; do binaries+=("${BUILD_DIR:-$root/build-gpu}/$t"); done
    bash "$root/../shared/tools/gpu-bundle.sh" "$bundle" "${binaries[@]}"
    ;;
  run)
    out=${2:-$root/gpu-check-out}
    mkdir -p "$out"
    # shellcheck disable=SC1091
    source "$bundle/env.sh"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
    status=0
    for t in "${gpu_tests[@]}"; do
      name=$(basename "$t")
      if ! "$bundle/bin/$name" --gtest_output="xml:$out/$name.xml" 2>&1 | tee "$out/$name.log"; then
        status=1
      fi
      if grep -q "SKIPPED \]" "$out/$name.log"; then
        echo "gpu-check: $name skipped tests on a GPU machine" >&2
        status=1
      fi
    done
    exit $status
    ;;
  *)
    echo "usage: $0 bundle | run [OUTDIR]" >&2
    exit 2
    ;;
esac
