#!/usr/bin/env bash
# Installs everything mlacp needs on a fresh Debian 12 machine. Idempotent: quiet and fast
# when every package is already present.
set -euo pipefail

packages=(
  build-essential cmake ccache git
  libtorch-dev libgloo-dev          # LibTorch 1.13 with c10d Gloo
  libopenblas0-pthread              # float32 GEMM off the reference netlib BLAS (slow)
  libgtest-dev libgmock-dev         # tests
  nlohmann-json3-dev libcli11-dev   # config.json / --json, the command line
  gnuplot-nox                       # loss-curve plots
  python3 procps                    # test scripts (the option fuzz harness, pgrep)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "mlacp setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
