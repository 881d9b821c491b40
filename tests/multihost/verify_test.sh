#!/usr/bin/env bash
# mlacp verify across two hosts x two ranks (testbed.sh: two network namespaces over a veth link
# shaped to 1 Gbit/s), ranks started with torchrun's variables: the representative matrix (both
# strategies, U = 4 whose all-to-alls cross the hosts, U = 2 inside them with all-gathers across,
# U = 1, packed documents, masks, TP, DP, bf16) and ad-hoc hybrids of each strategy, in float64
# against the single-device oracle with bytes equal to the formula; every rank exits 0.
# Usage: verify_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
source "$(dirname "$0")/testbed.sh"
testbed_begin 1gbit
work="$TB_WORK"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

run() {  # run NAME ARGS...: verify on the 4 ranks; rank 0's verdict
  local name="$1"
  shift
  local out
  out=$(testbed_world "$mlacp" --threads 1 verify --timeout 60 "$@")
  local rc=$?
  local verdict
  verdict=$(grep -E "^verify: " "$work/rank0.log" | tail -1)
  echo "$name: $verdict (exit codes: $(echo $out | tr '\n' ' '))"
  [ "$rc" -eq 0 ] && grep -q "passed" <<<"$verdict" || { fail "$name"; tail -5 "$work/rank0.log" | sed 's/^/    /'; }
  grep -q "^verify: 2 hosts: 10.233.0.1 (node 0) ranks \[0, 1\] | 10.233.0.2 (node 1) ranks \[2, 3\]" "$work/rank0.log" ||
    fail "$name: rank 0 did not name the two hosts"
}
run "representative matrix"
run "latent U=2 (all-gathers across the hosts)" --strategy latent --ulysses 2 --partition head_tail --doc-ends 40,96,128 --seq 128
run "expanded U=2 (all-gathers across the hosts)" --strategy expanded --ulysses 2 --partition contiguous --seq 64
run "expanded U=4 (all-to-alls across the hosts)" --strategy expanded --ulysses 4 --partition head_tail --seq 64
if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
