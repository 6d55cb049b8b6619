#!/usr/bin/env bash
# tests/deploy/run.sh BUILD_DIR: the deployment checks (deploy_test.py) in a virtual environment
# of their own (BUILD_DIR/deploy-venv, made once with pip from tests/deploy/requirements.txt).
# Needs kubectl (with kustomize) on PATH.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$(cd "$1" && pwd)
venv=$build/deploy-venv
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$here/requirements.txt" "$venv/requirements.txt"; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
  cp "$here/requirements.txt" "$venv/requirements.txt"
fi
command -v kubectl >/dev/null || { echo "tests/deploy needs kubectl (with kustomize) on PATH" >&2; exit 1; }
PATH=$venv/bin:$PATH exec "$venv/bin/python" "$here/deploy_test.py" "$build"
