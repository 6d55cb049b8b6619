#!/usr/bin/env bash
# Fails when a C++/CUDA source is not formatted by .clang-format (Google, 100 columns).
# Fix with: git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Debian 12's clang-format (14) is the reference; other versions may format slightly differently.
if [ -d .git ]; then
  files=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
else
  files=$(find . -path ./build\* -prune -o \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print)
fi
echo "$files" | xargs clang-format --dry-run -Werror
echo "check-format: every source is formatted"
