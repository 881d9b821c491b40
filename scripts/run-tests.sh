#!/usr/bin/env bash
# The whole test suite, both LibTorch versions and the Python package:
#   1. wheel: the C++ suite (CTest) against the LibTorch of the PyTorch 2.15 wheel (build-torch2/; a
#      CUDA build: the NCCL groups and mlacp_gpu_check, the CUDA path, compile and link here), every
#      test, the timing ones included (the multi-host bench, fault and plan tests, the planner's
#      grid) and the command-line fuzz and hostile-invocation tests; the Python package mlacp built
#      from the same CMake project and installed into .venv, its pytest suite (HuggingFace parity on
#      2 and 4 gloo processes, training, errors, torchrun --nnodes 2) and the peer benchmark's smoke
#      test (scripts/bench-peers.sh --quick: every system checked, mlacp exact and its bytes equal to
#      its formula) and its longest-S search under a per-rank memory cgroup (--longest --quick:
#      mlacp's leanest configuration reaches at least DeepSpeed-Ulysses's S);
#   2. sanitize: the C++ suite against Debian's LibTorch 1.13 under AddressSanitizer +
#      UndefinedBehaviorSanitizer (build-asan/, -O1): every test but the S = 8192 kernel-memory
#      test, bench's memory-estimate test (ten bench runs, DeepSeek-V3 dims among them: minutes
#      under the sanitizers), the option fuzz, the exactness matrix's second pass through the varlen
#      pieces (minutes each under the sanitizers; the pieces code runs sanitized in
#      kernels_pieces_test and the matrix's own pieces cases), the multi-host bench, fault,
#      plan and train tests (timings and time bounds; the multi-host verify runs sanitized), and
#      two command-line runs whose code runs sanitized in other tests: verify --case all on 4
#      ranks (check_cp_matrix_test runs the same cases on forked ranks; the launcher's 4 ranks run
#      in cli_verify_default_4_ranks) and train --compare (train_test's runs against the single
#      process; the comparison itself runs on the wheel leg). Any report fails it. This leg is the
#      suite's LibTorch 1.13 build and run.
# Optional: debian, the same suite unsanitized (-O2) against LibTorch 1.13 (build/, the build of
# scripts/run-main.sh). CI leaves it out: legs 1 and 2 run every one of its tests, and the leg cost
# a full build and 16 min of tests on 2 cores.
# Each GoogleTest binary runs all its cases in one process (tests/CMakeLists.txt, mlacp_test).
# The multi-host tests (tests/multihost/) make network namespaces: they need root, which CI has;
# elsewhere they are reported as skipped, with the reason.
# MLACP_TEST_LEGS="wheel sanitize" (the default) selects legs. Extra arguments go to every CTest run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
legs="${MLACP_TEST_LEGS:-wheel sanitize}"
jobs="${MLACP_TEST_JOBS:-2}"
t0=$SECONDS
"$root/scripts/setup.sh"
echo "mlacp tests: Debian setup (apt) took $((SECONDS - t0)) s"
for leg in $legs; do
  leg_start=$SECONDS
  case "$leg" in
    debian)
      echo "== mlacp tests: C++ suite, Debian LibTorch 1.13 =="
      MLACP_LIBTORCH=debian "$root/scripts/build.sh"
      (cd "$root/build" && ctest --output-on-failure -j "$jobs" "$@") ;;
    wheel)
      echo "== mlacp tests: C++ suite, PyTorch 2.15 wheel LibTorch; Python package =="
      t0=$SECONDS
      "$root/scripts/setup-python.sh"
      echo "mlacp tests: Python setup (.venv, PyTorch 2.15 wheel) took $((SECONDS - t0)) s"
      MLACP_LIBTORCH=wheel "$root/scripts/build.sh"
      # The CUDA compile (docs/DESIGN.md §16; no GPU here to run it): the wheel's LibTorch is a CUDA
      # build, so the tool links the NCCL groups and mlacp_gpu_check the fused-kernel calls.
      echo "== mlacp tests: the CUDA path compiled and linked (NCCL groups, fused attention kernels, mlacp_gpu_check) =="
      nm -C "$root/build-torch2/mlacp" | grep -c "c10d::ProcessGroupNCCL" >/dev/null \
        || { echo "run-tests: the tool was built without the NCCL groups" >&2; exit 1; }
      nm -C "$root/build-torch2/mlacp_gpu_check" | grep -c "_efficient_attention_forward" >/dev/null \
        || { echo "run-tests: mlacp_gpu_check is missing or lacks the CUDA attention calls" >&2; exit 1; }
      (cd "$root/build-torch2" && ctest --output-on-failure -j "$jobs" "$@")
      (cd "$root" && MLACP_BUILD_DIR="$root/build-torch2" "$root/.venv/bin/pip" install -q \
          --disable-pip-version-check --no-build-isolation --no-deps .)
      (cd "$root/tests/python" && "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider .)
      echo "== mlacp tests: the peer benchmark's smoke test (bench/peers --quick) =="
      "$root/scripts/bench-peers.sh" --quick --out "$root/build-torch2/peers-quick"
      echo "== mlacp tests: the longest S under a per-rank memory cap, smoke test (bench/peers --longest --quick) =="
      "$root/scripts/bench-peers.sh" --longest --quick --out "$root/build-torch2/peers-longest-quick" ;;
    sanitize)
      echo "== mlacp tests: C++ suite under AddressSanitizer + UndefinedBehaviorSanitizer (Debian LibTorch) =="
      t0=$SECONDS
      MLACP_LIBTORCH=debian MLACP_SANITIZE=1 "$root/scripts/build.sh"
      echo "mlacp tests: sanitizer build took $((SECONDS - t0)) s"
      (cd "$root/build-asan" && \
        ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}" UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}" \
        ctest --output-on-failure -j "$jobs" --timeout 900 \
          -E '^(kernels_blockwise_test\.s8192|cli_fuzz_invalid_options|cli_plan_grid_small|cli_bench_memory_estimate|check_cp_matrix_test\.pieces|multihost_(bench|faults|plan|train)|cli_verify_exactness_matrix_4_ranks|cli_train_compare)$' "$@") ;;
    *) echo "scripts/run-tests.sh: unknown leg '$leg' (debian | wheel | sanitize)" >&2; exit 2 ;;
  esac
  echo "mlacp tests: leg $leg took $((SECONDS - leg_start)) s"
done
echo "mlacp tests: all legs ($legs) passed in $SECONDS s"
