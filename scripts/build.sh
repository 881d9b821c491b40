#!/usr/bin/env bash
# Configures and builds mlacp into build/ (Release, ccache). Usage: scripts/build.sh [targets...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MLACP_BUILD_DIR:-$root/build}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"   # cache hits across clones (CI builds a fresh one)
jobs="${MLACP_BUILD_JOBS:-$(nproc)}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
if (($# > 0)); then
  targets=(); for t in "$@"; do targets+=(--target "$t"); done
  cmake --build "$build" -j "$jobs" "${targets[@]}"
else
  cmake --build "$build" -j "$jobs"
fi
