#!/usr/bin/env bash
# A rank killed mid-run makes the others exit with a clear error within the configured timeout.
# Starts 2 ranks the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), kills rank 1
# with SIGKILL while the cases run, and checks that rank 0 exits non-zero, in time, with an error.
set -u
mlacp="$1"
timeout_s=10
port=$(( 20000 + RANDOM % 20000 ))
cases=()
for _ in $(seq 300); do cases+=(latent-p2-u2-head_tail); done
work=$(mktemp -d)
trap 'cat "$work/r0.err" | tail -3; rm -rf "$work"; kill -9 $r0 $r1 2>/dev/null' EXIT
common=(verify --timeout "$timeout_s" --case "${cases[@]}")
env RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$mlacp" "${common[@]}" \
  >"$work/r0.out" 2>"$work/r0.err" & r0=$!
env RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$mlacp" "${common[@]}" \
  >"$work/r1.out" 2>"$work/r1.err" & r1=$!
# Wait until rank 0 has started running cases, then kill rank 1 mid-run.
for _ in $(seq 100); do grep -q "verify: \[3/" "$work/r0.err" 2>/dev/null && break; sleep 0.1; done
grep -q "verify: \[3/" "$work/r0.err" || { echo "FAIL: rank 0 never started its cases"; cat "$work/r0.err"; exit 1; }
start=$(date +%s.%N)
kill -9 $r1
wait $r0; status=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
echo "rank 0 exit status $status after ${elapsed}s; its last error line:"
tail -n 1 "$work/r0.err"
[ "$status" -eq 4 ] || { echo "FAIL: rank 0 exited $status, not 4 (a runtime fault)"; exit 1; }
grep -q "mlacp: communication: a collective failed: a peer rank exited or stalled" "$work/r0.err" \
  || { echo "FAIL: rank 0 did not say that a peer failed"; exit 1; }
grep -q "pair.cc\|Exception raised from\|frame #" <(grep -v "cause=" "$work/r0.err") \
  && { echo "FAIL: raw backend text outside the mlacp message"; exit 1; }
(( $(echo "$elapsed < $timeout_s + 5" | bc) )) || { echo "FAIL: rank 0 took ${elapsed}s (timeout ${timeout_s}s)"; exit 1; }
grep -qiE "mlacp: |error" "$work/r0.err" || { echo "FAIL: no clear error from rank 0"; exit 1; }
echo "PASS"
