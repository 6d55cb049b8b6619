#!/usr/bin/env bash
# The SASS of the MLA verify kernels, here, without a GPU: compiles
# kernels/cuda/mla_verify_attention.cu to a cubin with the GPU build's flags and disassembles it
# with nvdisasm (the toolkit here has none: it comes from PyPI's nvidia-cuda-nvdisasm the first
# time). Prints per kernel the instruction count, shared-memory (LDS/STS) and generic (LD.E/ST.E)
# accesses, wgmma (HGMMA), reciprocals (MUFU.RCP: 1/x, and one in every integer division by a
# run-time value) and barriers.
#
#   scripts/kernel-sass.sh [OUT.sass]      after `scripts/gpu-check.sh bundle` (needs build-gpu/)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build-gpu}
out=${1:-$build/mla_verify_attention.sass}
tools=$build/sass-tools
object=kernels/CMakeFiles/treeverify_kernels_cuda.dir/cuda/mla_verify_attention.cu.o

nvdisasm=$(command -v nvdisasm || true)
if [ -z "$nvdisasm" ] && [ -x /usr/local/cuda/bin/nvdisasm ]; then
  nvdisasm=/usr/local/cuda/bin/nvdisasm
fi
if [ -z "$nvdisasm" ]; then
  if [ -d "$tools/unpacked" ]; then
    nvdisasm=$(find "$tools/unpacked" -name nvdisasm -type f | head -n 1)
  fi
  if [ -z "$nvdisasm" ]; then
    mkdir -p "$tools"
    python3 -m pip download --quiet --no-deps nvidia-cuda-nvdisasm -d "$tools"
    python3 -m zipfile -e "$tools"/nvidia_cuda_nvdisasm-*.whl "$tools/unpacked"
    nvdisasm=$(find "$tools/unpacked" -name nvdisasm -type f | head -n 1)
    chmod +x "$nvdisasm"
  fi
fi

# The object's compile command from the build, turned into one that writes an sm_90a cubin.
command=$(cd "$build" && ninja -t commands "$object" | tail -n 1)
cubin=${out%.sass}.cubin
command=$(echo "$command" | sed -e "s# -o [^ ]*# -o $cubin#" -e 's# -MD##; s# -MT [^ ]*##' \
  -e 's# -MF [^ ]*##; s# -c # -cubin #' -e 's#--generate-code=[^ ]*#-arch=sm_90a#')
(cd "$build" && eval "$command") >/dev/null 2>&1
"$nvdisasm" -c "$cubin" >"$out"
echo "kernel-sass: $out"
python3 - "$out" <<'EOF'
import collections
import re
import sys

kernels = collections.OrderedDict()
name = None
for line in open(sys.argv[1]):
    header = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
    if header:
        name = header.group(1)
        kernels[name] = collections.Counter()
        continue
    instruction = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if name and instruction:
        op = instruction.group(1)
        counts = kernels[name]
        counts["instructions"] += 1
        for key, pattern in [("LDS/STS", r"(LDS|STS)(\.|$)"), ("generic LD/ST", r"(LD|ST)\.E"),
                             ("HGMMA", r"HGMMA"), ("MUFU.RCP", r"MUFU\.RCP"),
                             ("BAR", r"BAR\.|SYNCS")]:
            if re.match(pattern, op):
                counts[key] += 1
keys = ["instructions", "LDS/STS", "generic LD/ST", "HGMMA", "MUFU.RCP", "BAR"]
print("| kernel | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for name, counts in kernels.items():
    if "MlaVerify" in name:
        short = re.sub(r"^_ZN10treeverify7kernels4cuda3mla\d+", "", name)[:60]
        print(f"| {short} | " + " | ".join(str(counts[k]) for k in keys) + " |")
EOF
