#!/usr/bin/env bash
# `mlacp bench`'s memory estimate (made before anything is allocated: every strategy's modules, the
# largest step, the inputs; docs/DESIGN.md §8) against the run's measured peak (the LibTorch
# allocator counter, the rank that allocated most, from the inputs to the last step): within
# [1.0, 1.25] at small shapes (both strategies, K/V recompute; 4 ranks of 2 threads, whose kernel
# backward sums dK/dV through per-group partials) and at DeepSeek-V3's attention dims (16 heads,
# hidden 1024: the parameters weigh), float32 and bf16 autocast (what attention exchanges
# and its kernel's buffers counted at bf16 width, the projections' activations at float32 width, an
# upper bound: LibTorch 2.x keeps more of them in bf16, so bf16 is held within [1.0, 1.3]; measured
# 1.06-1.22x on 1.13, 1.08-1.26x on 2.x).
# Usage: bench_memory_estimate_test.sh MLACP WORKDIR
set -euo pipefail
mlacp="$(realpath "$1")"
work="$2"
mkdir -p "$work"
dims=(--hidden 128 --heads 8 --q-rank 48 --kv-rank 64 --nope 32 --rope 16 --value 32 --steps 2 --warmup 0)
failures=0
threads=1 nproc=2
check() {
  local name="$1"
  shift
  "$mlacp" --threads "$threads" bench --nproc "$nproc" "${dims[@]}" "$@" --json "$work/$name.json" >"$work/$name.log" 2>&1 ||
    { echo "FAIL: $name: bench failed"; tail -5 "$work/$name.log"; failures=$((failures + 1)); return; }
  python3 - "$name" "$work/$name.json" <<'PY' || failures=$((failures + 1))
import json, sys
name, path = sys.argv[1], sys.argv[2]
d = json.load(open(path))
peak, estimate = d["run_peak_bytes"], d["memory_estimate_bytes"]
ratio = estimate / peak
most = 1.3 if name.endswith("bf16") else 1.25
print(f"{name}: peak {peak / 2**20:.2f} MiB, estimate {estimate / 2**20:.2f} MiB ({ratio:.3f}x)")
if not 1.0 <= ratio <= most:
    sys.exit(f"FAIL: {name}: estimate / peak = {ratio:.3f}, outside [1.0, {most}]")
PY
}
check both-s1024 --seq 1024
check latent-kv-recompute-s2048 --seq 2048 --strategy latent_kv_head --kv-recompute
check expanded-s2048-b2 --seq 2048 --batch 2 --strategy expanded_ulysses
check both-s1024-bf16 --seq 1024 --dtype bfloat16
check latent-kv-recompute-s2048-bf16 --seq 2048 --strategy latent_kv_head --kv-recompute --dtype bfloat16
# Two threads a rank with fewer heads a call than twice that: the backward's dK/dV partials.
threads=2 nproc=4
check p4-threads2-s2048 --seq 2048
check p4-threads2-s2048-bf16 --seq 2048 --dtype bfloat16
check p4-threads2-kv-recompute-s2048-bf16 --seq 2048 --strategy latent_kv_head --kv-recompute --dtype bfloat16
threads=1 nproc=2
dims=(--hidden 1024 --heads 16 --q-rank 1536 --kv-rank 512 --nope 128 --rope 64 --value 128 --steps 1 --warmup 0)
check v3-both-s2048 --seq 2048
# bf16 at these dims: one strategy at S = 512. LibTorch multiplies bf16 at 1-2 GFLOP/s on a CPU
# without AVX-512 (AMD EPYC Zen 3: both strategies at S = 2048 took 4 min, past the timeout; one at
# S = 1024 took 53 s of CI, at S = 512 31 s, estimate / peak 1.08x).
check v3-latent-s512-bf16 --seq 512 --strategy latent_kv_head --dtype bfloat16
if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
