#!/usr/bin/env bash
# Installs everything treeverify builds with, from Debian's packages. Idempotent: packages that
# are already present are not fetched again.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git clang-format
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
      echo "install-deps: missing ${missing[*]}; run as root or install sudo" >&2
      exit 1
    fi
    sudo_cmd="sudo"
  fi
  # The variable goes after sudo: sudo resets the environment.
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
echo "install-deps: all build dependencies present"
