#!/usr/bin/env bash
# GPU checks, in two halves, because the GPU machine has CUDA but none of our Debian libraries:
#
#   scripts/gpu-check.sh bundle          here: builds the GPU tests and benchmarks (sm_90a) and
#                                        copies them with their libraries into .gpu-bundle/
#                                        (git-ignored); BUNDLE_PARTS=tests or benches for one
#                                        part (all of it exceeds the device tool's carry)
#   scripts/gpu-check.sh run [OUTDIR]    on the GPU machine, from the repository root: runs every
#                                        bundled test (a skipped test counts as a failure there;
#                                        SUITE_TIMEOUT bounds each suite, 240 s), the two-GPU
#                                        forward tests 8 times more where there are two GPUs, and
#                                        compute-sanitizer on small cases (SANITIZE=0: not)
#   scripts/gpu-check.sh bench [OUTDIR] [ARGS...]  on the GPU machine: the GPU benchmarks
#
# A/B runs of the attention benchmark (bench/NOTES.md: both builds in one call, alternated):
#   scripts/gpu-check.sh bundle-bench REV DIR [BINARY...]  here: mla_verify_bench (or the given
#                                                binaries, by build-tree path) of git revision REV,
#                                                built in .rev-worktree/ (git-ignored, kept, so a
#                                                second revision builds only what differs),
#                                                bundled into DIR
#   scripts/gpu-check.sh ab OUTDIR DIR... [-- ARGS...]  on the GPU machine: the benchmark of each
#                                                bundle DIR, alternated twice, ARGS passed on
#                                                (e.g. --only 8,1,16384,1); OUTDIR/NAME-PASS.json
#   scripts/bench-compare.py OUTDIR              here: the table of those runs
#
# A/B runs of the rank step (bench/NOTES.md from step 90):
#   scripts/gpu-check.sh rank-ab OUTDIR [NAME=]BENCH... [-- ARGS...]  on the GPU machine: two or
#                                                more rank_step_bench binaries (the bundle's
#                                                libraries) alternated twice (OUTDIR/NAME-PASS.json
#                                                and .log), then a CUPTI trace of one step of each
#                                                (OUTDIR/NAME-trace.tsv, for
#                                                scripts/kernel-timeline.py). NAME defaults to the
#                                                bundle directory of DIR/bin/rank_step_bench, else
#                                                the file's name. ARGS default to 4 layers, both
#                                                shardings, 46k, 1/16/64 nodes
#
# SUITES (run): the test binaries to run, by name (default: all of them), e.g.
#   SUITES="cuda_forward_ops_test cuda_forward_test" SANITIZE=0 scripts/gpu-check.sh run OUT
#
# With the device tool: BUNDLE_PARTS=tests scripts/gpu-check.sh bundle, carry .gpu-bundle and run
#   bash scripts/gpu-check.sh run $OUT
# then BUNDLE_PARTS=benches scripts/gpu-check.sh bundle and, in a second call,
#   bash scripts/gpu-check.sh bench $OUT
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=$root/.gpu-bundle
gpu_tests=(tests/kernels/cuda_rms_norm_test tests/kernels/cuda_forward_ops_test
           tests/kernels/cuda_block_fp8_gemm_test
           tests/kernels/cuda_mla_verify_attention_test tests/kernels/cuda_mha_prefill_attention_test
           tests/worker/cuda_forward_test
           tests/worker/cuda_golden_test tests/worker/nccl_communicator_test
           tests/worker/nvml_sampler_test
           tests/integration/cuda_service_test)
# What the service test starts, bundled beside the tests and named to them through the
# environment (tests/integration/replica.cc), as is the source tree (the golden fixtures).
gpu_programs=(services/treeverify-coordinator services/treeverify-worker)
gpu_benches=(bench/mla_verify_bench bench/wgmma_shape_probe bench/rank_step_bench
             bench/gemm_algo_probe bench/phase_stream_probe bench/weight_layout_probe)
# Small cases for compute-sanitizer, as test binary:gtest filter. memcheck and synccheck gate on
# every kernel. racecheck gates on the narrow and portable kernels and their merges (clean since
# run 87) and is recorded for the wide kernel, whose tile hand-off between its warpgroups racecheck
# also reports in a correct 60-line kernel (bench/NOTES.md, steps 45-46).
sanitized=("cuda_mla_verify_attention_test:*GraphReplay*:*TinyModel*"
           "cuda_mha_prefill_attention_test:*" "cuda_forward_ops_test:*MoeExperts*"
           "cuda_block_fp8_gemm_test:*")
race_gating=("cuda_mla_verify_attention_test:*EveryNarrowRowTile*:*PortableKernelAtProductionDims*"
             "cuda_mha_prefill_attention_test:*Nope16*" "cuda_forward_ops_test:*MoeExperts*"
             "cuda_block_fp8_gemm_test:*")
race_recorded=("cuda_mla_verify_attention_test:*ProductionDimsMatchTheCpuBackend*")

case "${1:-}" in
  bundle)
    # BUNDLE_PARTS=tests (the tests and the programs the service test starts) or benches: all of
    # it is ~70 MB, over the device tool's 64 MiB carry, so a call carries one part.
    case ${BUNDLE_PARTS:-all} in
      tests) parts=("${gpu_tests[@]}" "${gpu_programs[@]}") ;;
      benches) parts=("${gpu_benches[@]}") ;;
      all) parts=("${gpu_tests[@]}" "${gpu_benches[@]}" "${gpu_programs[@]}") ;;
      *) echo "BUNDLE_PARTS must be tests, benches or all" >&2; exit 2 ;;
    esac
    BUILD_DIR=${BUILD_DIR:-$root/build-gpu} CUDA_ARCHS=${CUDA_ARCHS:-90a} \
      "$root/scripts/build.sh" -DTREEVERIFY_CUDA=ON
    rm -rf "$bundle"
    binaries=()
    for t in "${parts[@]}"; do
      binaries+=("${BUILD_DIR:-$root/build-gpu}/$t")
    done
    bash "$root/../shared/tools/gpu-bundle.sh" "$bundle" "${binaries[@]}"
    # Host symbols are not needed there (the kernels' line tables are in their own images).
    strip "$bundle"/bin/* 2>/dev/null || true
    # The timeline tracer (bench/cupti_trace.cc), loaded by the driver, not linked: beside the libraries.
    if [ -e "${BUILD_DIR:-$root/build-gpu}/bench/libcupti_trace.so" ]; then
      cp "${BUILD_DIR:-$root/build-gpu}/bench/libcupti_trace.so" "$bundle/lib/"
    fi
    ;;
  run)
    out=${2:-$root/gpu-check-out}
    mkdir -p "$out"
    # shellcheck disable=SC1091
    source "$bundle/env.sh"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
    export TREEVERIFY_SOURCE_DIR=$root
    export TREEVERIFY_COORDINATOR_BINARY=$bundle/bin/treeverify-coordinator
    export TREEVERIFY_WORKER_BINARY=$bundle/bin/treeverify-worker
    # NVLink multicast stays off on the shared GPU machines (the device tool's KINDS.md).
    export NCCL_NVLS_ENABLE=0
    # Tests named *OnTwoGpus need two GPUs; with one they are left out, and the check says so.
    filter=()
    if [ "$(nvidia-smi --list-gpus | wc -l)" -lt 2 ]; then
      filter=(--gtest_filter=-*OnTwoGpus)
      echo "gpu-check: one GPU: the *OnTwoGpus tests are not run (the nvidia-h200-x2 kind runs them)"
    fi
    status=0
    # Each suite is bounded, so that a hang fails its suite and the check goes on to the next.
    for t in "${gpu_tests[@]}"; do
      name=$(basename "$t")
      if [ -n "${SUITES:-}" ] && [[ " $SUITES " != *" $name "* ]]; then continue; fi
      if ! timeout -s INT "${SUITE_TIMEOUT:-240}" "$bundle/bin/$name" "${filter[@]}" \
          >"$out/$name.log" 2>&1; then
        status=1
        echo "gpu-check: $name failed or timed out (${SUITE_TIMEOUT:-240} s)" >&2
      fi
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|error" "$out/$name.log" | sed "s/^/$name: /" || true
      if grep -q "SKIPPED \]" "$out/$name.log"; then
        echo "gpu-check: $name skipped tests on a GPU machine" >&2
        status=1
      fi
      cat "$out/$name.log" >>"$out/tests.log" && rm "$out/$name.log"
    done
    # The two-GPU forward tests again, repeated: ranks over NCCL hung once in a few runs (bench/
    # NOTES.md, step 95), which one pass does not show.
    if [ ${#filter[@]} -eq 0 ] && [[ -z "${SUITES:-}" || " $SUITES " == *" cuda_forward_test "* ]]; then
      if ! timeout -s INT 120 "$bundle/bin/cuda_forward_test" --gtest_filter='*OnTwoGpus' \
          --gtest_repeat=8 >"$out/two-gpu-repeat.log" 2>&1; then
        status=1
        echo "gpu-check: the two-GPU forward tests failed or hung in 8 repeats" >&2
      fi
      grep -c "OK \]" "$out/two-gpu-repeat.log" | sed 's/^/two-GPU repeats, tests passed: /'
      cat "$out/two-gpu-repeat.log" >>"$out/tests.log" && rm "$out/two-gpu-repeat.log"
    fi
    # One compute-sanitizer pass; its failure fails the check when `gating` is yes.
    sanitize() {
      local tool=$1 gating=$2 entry=$3
      local name=${entry%%:*} tests=${entry#*:}
      local log=$out/sanitizer-$tool.log
      if ! compute-sanitizer --tool "$tool" --error-exitcode 3 "$bundle/bin/$name" \
          --gtest_filter="$tests" >"$log" 2>&1; then
        if [ "$gating" = yes ]; then
          echo "gpu-check: compute-sanitizer $tool failed on $name ($tests)" >&2
          status=1
        else
          echo "gpu-check: $tool reported hazards on $name ($tests; recorded, not gating)" >&2
        fi
      fi
      tail -n 2 "$log" | sed "s/^/$tool $name: /"
      if [ "$tool" = racecheck ]; then
        python3 "$root/scripts/racecheck-summary.py" "$log" | sed "s/^/$tool $name: /"
      fi
      cat "$log" >>"$out/sanitizer.log" && rm "$log"
    }
    # SANITIZE=0 leaves the sanitizers out (a call of its own when one call would run past the
    # device tool's 10 minutes: the suites and the two-GPU repeats take about 5 of them).
    if [ "${SANITIZE:-1}" = 0 ]; then
      echo "gpu-check: sanitizers left out (SANITIZE=0)"
      exit $status
    fi
    for entry in "${sanitized[@]}"; do
      sanitize memcheck yes "$entry"
      sanitize synccheck yes "$entry"
    done
    for entry in "${race_gating[@]}"; do sanitize racecheck yes "$entry"; done
    for entry in "${race_recorded[@]}"; do sanitize racecheck no "$entry"; done
    exit $status
    ;;
  bench)
    out=${2:-$root/gpu-check-out}
    mkdir -p "$out"
    # shellcheck disable=SC1091
    source "$bundle/env.sh"
    "$bundle/bin/wgmma_shape_probe" --out "$out"
    "$bundle/bin/gemm_algo_probe" --out "$out"
    "$bundle/bin/mla_verify_bench" --out "$out" "${@:3}"
    ;;
  bundle-bench)
    rev=${2:?usage: $0 bundle-bench REV DIR [BINARY...]}
    dir=${3:?usage: $0 bundle-bench REV DIR [BINARY...]}
    # Binaries by their path in the build tree (default: the attention benchmark), e.g.
    # bench/rank_step_bench tests/kernels/cuda_forward_ops_test for a branch's A/B and tests.
    binaries=("${@:4}")
    if [ ${#binaries[@]} -eq 0 ]; then binaries=(bench/mla_verify_bench); fi
    targets=()
    for binary in "${binaries[@]}"; do targets+=("$(basename "$binary")"); done
    # One worktree for every revision, kept with its build tree: switching revisions touches only
    # the files that differ, so ninja rebuilds only what depends on them.
    tree=$root/.rev-worktree
    if [ ! -e "$tree/.git" ]; then
      git -C "$root" worktree add --detach -q "$tree" "$rev"
    else
      git -C "$tree" checkout --detach -q "$rev"
    fi
    SOURCE_DIR=$tree BUILD_DIR=$tree/build-gpu TARGETS="${targets[*]}" \
      "$root/scripts/build.sh" -DTREEVERIFY_CUDA=ON >/dev/null
    rm -rf "$dir"
    paths=()
    for binary in "${binaries[@]}"; do paths+=("$tree/build-gpu/$binary"); done
    bash "$root/../shared/tools/gpu-bundle.sh" "$dir" "${paths[@]}"
    ;;
  ab)
    out=${2:?usage: $0 ab OUTDIR DIR... [-- ARGS...]}
    shift 2
    dirs=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
      dirs+=("$1")
      shift
    done
    if [ "${1:-}" = -- ]; then shift; fi
    mkdir -p "$out"
    for pass in 1 2; do
      for dir in "${dirs[@]}"; do
        name=$(basename "$dir")
        scratch=$(mktemp -d)
        # shellcheck disable=SC1091
        if ! (source "$dir/env.sh" && "$dir/bin/mla_verify_bench" --out "$scratch" "$@" \
            >"$scratch/log" 2>&1); then
          echo "gpu-check: $name failed (pass $pass)" >&2
          tail -n 20 "$scratch/log" >&2
          exit 1
        fi
        cp "$scratch/mla_verify.json" "$out/$name-$pass.json"
        rm -rf "$scratch"
      done
    done
    ;;
  rank-ab)
    usage="usage: $0 rank-ab OUTDIR [NAME=]BENCH... [-- ARGS...]"
    out=${2:?$usage}
    shift 2
    names=()
    declare -A bench_of=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
      if [[ $1 == *=* ]]; then
        name=${1%%=*}
        path=${1#*=}
      else
        path=$1
        name=$(basename "$path")
        # A bundle's benchmark (bundle-bench's DIR/bin/rank_step_bench) is named by its bundle.
        if [ "$name" = rank_step_bench ] && [ "$(basename "$(dirname "$path")")" = bin ]; then
          name=$(basename "$(dirname "$(dirname "$path")")")
        fi
      fi
      if [ -n "${bench_of[$name]:-}" ]; then
        echo "gpu-check: two benches named $name; name them NAME=BENCH" >&2
        exit 2
      fi
      names+=("$name")
      bench_of[$name]=$path
      shift
    done
    if [ ${#names[@]} -lt 2 ]; then
      echo "$usage" >&2
      exit 2
    fi
    if [ "${1:-}" = -- ]; then shift; fi
    args=("$@")
    if [ ${#args[@]} -eq 0 ]; then
      # shellcheck disable=SC2054  # the commas belong to the bench's lists
      args=(--layers 4 --sharding split,whole --contexts 46080 --trees 1,16,64 --iters 10)
    fi
    mkdir -p "$out"
    # shellcheck disable=SC1091
    source "$bundle/env.sh"
    for pass in 1 2; do
      for name in "${names[@]}"; do
        if ! timeout 150 "${bench_of[$name]}" "${args[@]}" --json "$out/$name-$pass.json" \
            >"$out/$name-$pass.log" 2>&1; then
          echo "gpu-check: $name failed (pass $pass)" >&2
          tail -n 20 "$out/$name-$pass.log" >&2
          exit 1
        fi
      done
    done
    for name in "${names[@]}"; do
      CUDA_INJECTION64_PATH=$bundle/lib/libcupti_trace.so TREEVERIFY_TRACE=$out/$name-trace.tsv \
        timeout 90 "${bench_of[$name]}" --layers 4 --sharding split --contexts 46080 --trees 16 \
        --iters 3 >"$out/$name-trace.log" 2>&1 || echo "gpu-check: the $name trace failed" >&2
    done
    for name in "${names[@]}"; do
      grep -h "tree 16" "$out/$name-2.log" | sed "s/^/$name: /" || true
    done
    ;;
  *)
    echo "usage: $0 bundle | run [OUTDIR] | bench [OUTDIR] [ARGS...] |" \
      "bundle-bench REV DIR [BINARY...] | ab OUTDIR DIR... [-- ARGS...] |" \
      "rank-ab OUTDIR [NAME=]BENCH... [-- ARGS...]" >&2
    exit 2
    ;;
esac
