#!/usr/bin/env bash
# Configures and builds mlacp (Release, ccache). Usage: scripts/build.sh [targets...]
#   MLACP_LIBTORCH=debian (default): Debian's LibTorch 1.13, into build/
#   MLACP_LIBTORCH=wheel: the LibTorch inside the PyTorch 2.x wheel of .venv (scripts/setup-python.sh),
#                         into build-torch2/, with the Python extension mlacp._C
#   MLACP_SANITIZE=1 (with debian): AddressSanitizer + UndefinedBehaviorSanitizer, into build-asan/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
libtorch="${MLACP_LIBTORCH:-debian}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-8G}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"   # cache hits across clones (CI builds a fresh one)
# The sanitizer build has debug info (-g1), and ccache then hashes the working folder by default: a
# fresh clone (CI's) missed every object. Debug info may name the folder of the first build.
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
jobs="${MLACP_BUILD_JOBS:-$(nproc)}"
case "$libtorch" in
  debian)
    if [[ "${MLACP_SANITIZE:-0}" == 1 ]]; then
      # -O1 keeps the suite's multi-rank tests within CI time; every UB report is an error.
      build="${MLACP_BUILD_DIR:-$root/build-asan}"
      san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
      cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Sanitize -DCMAKE_CXX_FLAGS_SANITIZE="-O1 -g1 -DNDEBUG" \
        -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
    else
      build="${MLACP_BUILD_DIR:-$root/build}"
      cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
    fi ;;
  wheel)
    build="${MLACP_BUILD_DIR:-$root/build-torch2}"
    python="${MLACP_VENV:-$root/.venv}/bin/python"
    torch_dir="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
    # No GPU to detect here: name the CUDA architecture so the wheel's CMake config does not probe.
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
      -DMLACP_BUILD_PYTHON=ON -DPython3_EXECUTABLE="$python" \
      -DCMAKE_PREFIX_PATH="$torch_dir;$torch_dir/share/cmake" >/dev/null ;;
  *) echo "scripts/build.sh: MLACP_LIBTORCH must be debian or wheel (got '$libtorch')" >&2; exit 2 ;;
esac
if (($# > 0)); then
  targets=(); for t in "$@"; do targets+=(--target "$t"); done
  cmake --build "$build" -j "$jobs" "${targets[@]}"
else
  cmake --build "$build" -j "$jobs"
fi
