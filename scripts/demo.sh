#!/usr/bin/env bash
# The README's demo command. Installs what is missing, builds, generates a tiny random
# DeepSeek-V3-style checkpoint (once), starts the coordinator and two CPU worker processes
# (tensor parallel, Gloo over loopback), waits until the service is SERVING, then drives it with
# treeverify-cli: plain decoding, the ngram drafter and the noisy-oracle drafter (acceptance 0.8),
# printing tokens, accepted tokens per step and tokens per second, then the processes' Prometheus
# endpoints and a few of the series they hold. Everything it started is stopped on exit, Ctrl-C
# or failure.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
build_dir=${BUILD_DIR:-$root/build}
cli="$build_dir/tools/treeverify-cli"
model_dir=${MODEL_DIR:-$build_dir/demo-model}
run_dir=$(mktemp -d /tmp/treeverify-demo.XXXXXX)

pids=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  # Each child leads its own session (setsid): Ctrl-C reaches only this script, which then asks
  # every child once to drain and exit.
  for pid in ${pids[@]+"${pids[@]}"}; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in ${pids[@]+"${pids[@]}"}; do wait "$pid" 2>/dev/null || true; done
  if [ $status -ne 0 ]; then
    echo "demo failed; process logs:" >&2
    tail -n 20 "$run_dir"/*.log >&2 || true
  fi
  rm -rf "$run_dir"
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -f "$model_dir/config.json" ] || "$cli" make-checkpoint --out "$model_dir" --preset demo --seed 7

# Prints the last word of the first line of a process's log containing MARKER, waiting for it:
# "... listening on HOST:PORT" and "... metrics on http://HOST:PORT/metrics" (ports are picked
# by the kernel).
logged_address() {
  local log=$1 marker=$2
  for _ in $(seq 1 600); do
    if grep -q "$marker" "$log" 2>/dev/null; then
      grep -m1 "$marker" "$log" | awk '{print $NF}'
      return 0
    fi
    sleep 0.1
  done
  echo "no '$marker' address in $log" >&2
  return 1
}

# GET http://HOST:PORT/PATH with bash alone (no HTTP client needed).
http_get() {
  local url=${1#http://} host port path
  host=${url%%:*}
  port=${url#*:}
  port=${port%%/*}
  path=/${url#*/}
  exec 3<>"/dev/tcp/$host/$port"
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$path" "$host" >&3
  sed '1,/^\r$/d' <&3
  exec 3<&-
}

setsid "$build_dir/services/treeverify-coordinator" --listen 127.0.0.1:0 --world-size 2 \
  --model-name demo --metrics-listen 127.0.0.1:0 >"$run_dir/coordinator.log" 2>&1 &
pids+=($!)
coordinator=$(logged_address "$run_dir/coordinator.log" "listening on")
# Two worker processes share this machine's cores: one OpenMP thread each, and no spinning.
for rank in 0 1; do
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE \
    setsid "$build_dir/services/treeverify-worker" --rank $rank --world-size 2 --coordinator "$coordinator" \
    --model "$model_dir" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    >"$run_dir/worker$rank.log" 2>&1 &
  pids+=($!)
done
# Foreground work runs as `cmd & wait`, so a signal to this script is handled at once.
"$cli" info --server "$coordinator" --wait-s 120 &
wait $!

prompt=1,2,3,4,5,1,2,3,4,5,1,2,3
for drafter in none ngram noisy-oracle; do
  echo
  echo "== generate, drafter: $drafter"
  "$cli" generate --server "$coordinator" --prompt-ids "$prompt" --max-new-tokens 48 \
    --drafter "$drafter" --tree-nodes 8 --oracle-acceptance 0.8 &
  wait $!
done
echo
echo "coordinator: $coordinator (gRPC Verifier API, health, reflection)."
coordinator_metrics=$(logged_address "$run_dir/coordinator.log" "metrics on")
echo "metrics: $coordinator_metrics (coordinator)"
for rank in 0 1; do
  echo "metrics: $(logged_address "$run_dir/worker$rank.log" "metrics on") (worker rank $rank)"
done
echo
echo "== from the coordinator's /metrics (monitoring/README.md lists every series):"
http_get "$coordinator_metrics" | grep -E '^treeverify_(emitted_tokens|drafts|draft_tokens|accepted_tokens)_total|^treeverify_step_seconds_(count|sum)|^treeverify_requests_total'
