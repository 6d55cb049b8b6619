#!/usr/bin/env bash
# The README's demo command. Installs what is missing, builds, generates a tiny random
# DeepSeek-V3-style checkpoint, and runs greedy generation on the CPU backend with 2
# tensor-parallel ranks (threads of one process, for now; the coordinator + worker processes
# replace this once the service lands).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build_dir=${BUILD_DIR:-$root/build}
model_dir=${MODEL_DIR:-$build_dir/demo-model}
cli="$build_dir/tools/treeverify-cli"
"$cli" make-checkpoint --out "$model_dir" --preset demo --seed 7
"$cli" generate --model "$model_dir" --prompt-ids 1,2,3,4,5 --max-new-tokens 16 --tp 2
