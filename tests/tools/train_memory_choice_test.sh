#!/usr/bin/env bash
# `mlacp train` under a memory limit its plain estimate exceeds: the launcher turns on the cheapest
# recomputation that fits (--kv-recompute, then --recompute, then both), says so, and the run
# trains. The limits are set between the run's own estimates (read from the memory check's
# message with a limit nothing fits), so the test follows the estimate wherever it is calibrated.
# Usage: train_memory_choice_test.sh MLACP
set -euo pipefail
mlacp="$(realpath "$1")"
run=(train --nproc 2 --steps 1 --seq 4096 --strategy latent)

# Per-host bytes of the run with the given flags, from "... ranks on this host = N MiB, limit=...".
estimate() {
  local text
  text="$("$mlacp" --memory-limit 0.000001 "${run[@]}" "$@" 2>&1 || true)"
  python3 - "$text" <<'PY'
import re, sys
m = re.search(r"ranks on this host = ([0-9.]+) (B|KiB|MiB|GiB)", sys.argv[1])
if not m:
    sys.exit("no estimate in: " + sys.argv[1][-400:])
print(float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)])
PY
}
plain=$(estimate)
kv=$(estimate --kv-recompute)
layers=$(estimate --recompute)
both=$(estimate --kv-recompute --recompute)
echo "estimates (bytes, 2 ranks): plain $plain, kv $kv, layers $layers, both $both"
python3 -c "import sys; p,k,l,b=map(float,sys.argv[1:]); sys.exit(0 if b < l < k < p else 'expected both < layers < kv < plain')" \
  "$plain" "$kv" "$layers" "$both"

# A limit between two estimates, in GiB.
between() { python3 -c "import sys; print((float(sys.argv[1]) + float(sys.argv[2])) / 2 / 2**30)" "$1" "$2"; }
check() {  # limit, expected flags
  local out
  out="$("$mlacp" --memory-limit "$1" "${run[@]}" 2>&1)" || { echo "FAIL: limit $1 GiB: the run failed"; echo "$out" | tail -5; exit 1; }
  grep -q "running with $2\$" <<<"$out" || { echo "FAIL: limit $1 GiB: expected 'running with $2'"; echo "$out" | tail -5; exit 1; }
  grep -q "^train: 1 steps" <<<"$out" || { echo "FAIL: limit $1 GiB: no step report"; echo "$out" | tail -5; exit 1; }
  echo "limit $1 GiB: running with $2"
}
check "$(between "$plain" "$kv")" "--kv-recompute"
check "$(between "$kv" "$layers")" "--recompute"
check "$(between "$layers" "$both")" "--kv-recompute --recompute"
echo PASS
