#!/usr/bin/env bash
# collect-runtime.sh OUTDIR BINARY...: the image's runtime layer. Copies the binaries into
# OUTDIR/bin and every shared library they load into OUTDIR/lib, except what the runtime base
# image or the node provides: the C and C++ runtime, and (for CUDA images) the driver, which the
# NVIDIA container toolkit mounts, and the CUDA runtime and cuBLAS of the CUDA runtime image.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 OUTDIR BINARY..." >&2; exit 2; fi
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
provided='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libgcc_s|libstdc\+\+|libcuda\.so|libnvidia|libcudart|libcublas)'
for binary in "$@"; do
  cp -L "$binary" "$out/bin/"
  ldd "$binary" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ $name =~ $provided ]] && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
  done
done
