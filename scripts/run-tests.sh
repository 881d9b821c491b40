#!/usr/bin/env bash
# The whole test suite, both LibTorch versions and the Python package:
#   1. the C++ suite (CTest) against Debian's LibTorch 1.13 (build/);
#   2. the C++ suite against the LibTorch of the PyTorch 2.15 wheel (build-torch2/), the Python
#      package mlacp built from the same CMake project and installed into .venv, its pytest
#      suite (HuggingFace parity on 2 and 4 gloo processes, training, errors) and the peer
#      benchmark's smoke test (scripts/bench-peers.sh --quick: every system checked, mlacp exact
#      and its bytes equal to its formula).
# MLACP_TEST_LEGS=debian|wheel runs one leg only. Extra arguments go to both CTest runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
legs="${MLACP_TEST_LEGS:-debian wheel}"
jobs="${MLACP_TEST_JOBS:-2}"
t0=$SECONDS
"$root/scripts/setup.sh"
echo "mlacp tests: Debian setup (apt) took $((SECONDS - t0)) s"
for leg in $legs; do
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
      (cd "$root/build-torch2" && ctest --output-on-failure -j "$jobs" "$@")
      (cd "$root" && MLACP_BUILD_DIR="$root/build-torch2" "$root/.venv/bin/pip" install -q \
          --disable-pip-version-check --no-build-isolation --no-deps .)
      (cd "$root/tests/python" && "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider .)
      echo "== mlacp tests: the peer benchmark's smoke test (bench/peers --quick) =="
      "$root/scripts/bench-peers.sh" --quick --out "$root/build-torch2/peers-quick" ;;
    *) echo "scripts/run-tests.sh: unknown leg '$leg' (debian | wheel)" >&2; exit 2 ;;
  esac
done
