#!/usr/bin/env bash
# The README's test command: installs what is missing (the tests' Prometheus too), builds, and
# runs every test.
# GPU tests (label gpu) skip visibly on machines without a GPU; run them on one with
# scripts/gpu-check.sh.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/install-deps.sh" --test
"$root/scripts/check-format.sh"
"$root/scripts/build.sh"
build_dir=${BUILD_DIR:-$root/build}
cd "$build_dir"
ctest --output-on-failure --timeout 600 -j "${JOBS:-$(nproc)}"
