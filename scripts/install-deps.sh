#!/usr/bin/env bash
# Installs everything treeverify builds with, from Debian's packages. Idempotent: packages that
# are already present are not fetched again. With --test, also what the tests run: a real
# Prometheus and promtool (Debian's `prometheus`; its system service is neither started nor
# enabled: the tests start their own server on a free loopback port).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git clang-format
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
)
test_packages=(prometheus)
if [ "${1:-}" = "--test" ]; then
  packages+=("${test_packages[@]}")
  # tests/deploy makes a virtual environment: Debian's own python3 needs python3-venv for it.
  if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then packages+=(python3-venv); fi
fi
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
  # A package's service is not started during the install (policy-rc.d 101: "action forbidden"),
  # unless the machine already has a policy of its own.
  policy=/usr/sbin/policy-rc.d
  added_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo_cmd tee "$policy" >/dev/null
    $sudo_cmd chmod +x "$policy"
    added_policy=1
  fi
  status=0
  $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || status=$?
  if [ -n "$added_policy" ]; then $sudo_cmd rm -f "$policy"; fi
  [ $status -eq 0 ] || exit $status
  for p in "${missing[@]}"; do
    if [ "$p" = prometheus ] && command -v systemctl >/dev/null; then
      $sudo_cmd systemctl disable prometheus.service >/dev/null 2>&1 || true  # not at boot either
    fi
  done
fi
echo "install-deps: all build dependencies present"
