#!/usr/bin/env bash
# mlacp side by side with the Python context-parallel systems (DeepSpeed-Ulysses, yunchang,
# torch's context_parallel) and the single-process HuggingFace layer, on the same MLA job, over
# real gloo (bench/peers). Sets up what it needs (.venv with the pinned peers, the wheel build of
# mlacp's Python package), then runs; arguments go to the benchmark (--help lists them):
#   scripts/bench-peers.sh            # P = 2, 4; S = 2K, 4K; float32 and bf16 (~15 min on 2 cores)
#   scripts/bench-peers.sh --quick    # smoke test (CI): S = 256, one repetition, bf16 at P = 2 only
#                                     # (an AMD EPYC Zen 3 without bf16 arithmetic multiplies bf16
#                                     # at about 1 GFLOP/s: bf16 points dominate the smoke test)
# Results: out/peers/{table.md,results.json,steps.png} (--out DIR).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/setup-python.sh"
if ! "$root/.venv/bin/python" -c "import mlacp._C" 2>/dev/null || [ -n "${MLACP_REBUILD:-}" ]; then
  MLACP_LIBTORCH=wheel "$root/scripts/build.sh"
  (cd "$root" && MLACP_BUILD_DIR="$root/build-torch2" "$root/.venv/bin/pip" install -q \
      --disable-pip-version-check --no-build-isolation --no-deps .)
fi
cd "$root"
export DS_ACCELERATOR=cpu PYTHONWARNINGS="ignore"
exec "$root/.venv/bin/python" -m bench.peers "$@"
