#!/usr/bin/env bash
# Rendezvous under torchrun-style variables: a taken MASTER_PORT is an invalid input naming the
# port (exit 2), a MASTER_ADDR that does not resolve is one naming the address (exit 2, at once),
# a rank whose peers never come or whose store address does not answer fails within about one
# --timeout (exit 4) with an mlacp message, and none prints c10d's raw text (its glog lines) or a
# stack trace.
# Usage: rendezvous_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
work=$(mktemp -d)
holder=0
trap 'kill "$holder" 2>/dev/null; rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
raw='frame #\|Exception raised from\|\[c10d\]\|Logging before InitGoogleLogging'

port=$(( 20000 + RANDOM % 20000 ))
python3 -c "
import socket, sys, time
s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('::', $port)); s.listen(1); print('ready', flush=True); time.sleep(120)" >"$work/holder.out" 2>&1 &
holder=$!
for _ in $(seq 50); do grep -q ready "$work/holder.out" && break; sleep 0.1; done
out=$(env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$mlacp" verify --timeout 5 \
      --case latent-p2-u2-head_tail 2>&1); rc=$?
if [ "$rc" -ne 2 ] || ! grep -q "mlacp: process groups: rank 0 cannot serve the rendezvous store: MASTER_PORT is taken" <<<"$out" \
   || ! grep -q "MASTER_PORT=$port" <<<"$out" || grep -q "$raw" <<<"$out"; then
  fail "taken MASTER_PORT (exit $rc)"; echo "$out" | tail -3 | sed 's/^/    /'
fi
kill "$holder" 2>/dev/null

port=$(( 20000 + RANDOM % 20000 ))
start=$SECONDS
out=$(env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$mlacp" verify --timeout 4 \
      --case latent-p2-u2-head_tail 2>&1); rc=$?
took=$((SECONDS - start))
if [ "$rc" -ne 4 ] || ! grep -q "mlacp: process groups: not every rank arrived at the rendezvous within the timeout" <<<"$out" \
   || ! grep -q "missing_ranks=\[1\]" <<<"$out" || grep -q "$raw" <<<"$out"; then
  fail "a missing rank (exit $rc)"; echo "$out" | tail -3 | sed 's/^/    /'
fi
[ "$took" -le 8 ] || fail "a missing rank took ${took}s with --timeout 4 (bound: one timeout plus start-up)"
echo "missing rank: exit $rc after ${took}s (--timeout 4)"

# Rank 1 with a MASTER_ADDR that names no host (c10d retried it with a log line a second), and one
# that resolves but does not answer (TEST-NET-1, RFC 5737).
out=$(env RANK=1 WORLD_SIZE=2 MASTER_ADDR=no-such-host.invalid MASTER_PORT=$port timeout 60 "$mlacp" verify --timeout 4 \
      --case latent-p2-u2-head_tail 2>&1); rc=$?
if [ "$rc" -ne 2 ] || ! grep -q "^mlacp: process groups: MASTER_ADDR must be a host name or address that resolves" <<<"$out" \
   || grep -q "$raw" <<<"$out"; then
  fail "an unresolvable MASTER_ADDR (exit $rc)"; echo "$out" | tail -3 | sed 's/^/    /'
fi
out=$(env RANK=1 WORLD_SIZE=2 MASTER_ADDR=192.0.2.1 MASTER_PORT=$port timeout 60 "$mlacp" verify --timeout 2 \
      --case latent-p2-u2-head_tail 2>&1); rc=$?
if [ "$rc" -ne 4 ] || ! grep -q "^mlacp: process groups: the rendezvous store at MASTER_ADDR:MASTER_PORT could not be reached" <<<"$out" \
   || grep -q "$raw" <<<"$out"; then
  fail "an unreachable MASTER_ADDR (exit $rc)"; echo "$out" | tail -3 | sed 's/^/    /'
fi
if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
