#!/usr/bin/env bash
# Fails when a C++/CUDA source is not formatted by .clang-format (Google, 100 columns).
# Fix with: git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run -Werror
echo "check-format: every source is formatted"
