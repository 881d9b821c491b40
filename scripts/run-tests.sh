#!/usr/bin/env bash
# The whole test suite: set up, build, run CTest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "${MLACP_BUILD_DIR:-$root/build}"
exec ctest --output-on-failure -j "${MLACP_TEST_JOBS:-2}" "$@"
