#!/usr/bin/env bash
# A rank stopped with SIGSTOP mid-run: the others time out waiting for it, and the launcher names
# the stopped rank (not the first survivor that gave up), exits with the survivor's fault code 4,
# and leaves no process behind.
# Usage: stopped_rank_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
work=$(mktemp -d)
pid=0
trap 'kill -KILL -- "-$pid" 2>/dev/null; rm -rf "$work"' EXIT
cases=()
for _ in $(seq 400); do cases+=(latent-p2-u2-head_tail); done
(cd "$work" && exec setsid "$mlacp" verify --nproc 2 --timeout 5 --case "${cases[@]}" --json "$work/marker.json" \
   >"$work/out" 2>&1) &
pid=$!
for _ in $(seq 100); do grep -q "\[5/" "$work/out" 2>/dev/null && break; sleep 0.1; done
grep -q "\[5/" "$work/out" || { echo "FAIL: the ranks never started their cases"; tail -5 "$work/out"; exit 1; }
rank1=""
for p in $(pgrep -f "$work/marker.json"); do
  [ "$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^RANK=//p')" = "1" ] && rank1=$p
done
[ -n "$rank1" ] || { echo "FAIL: rank 1's process not found"; exit 1; }
start=$SECONDS
kill -STOP "$rank1"
wait "$pid"; rc=$?
took=$((SECONDS - start))
echo "launcher exit $rc after ${took}s; its last line: $(tail -1 "$work/out")"
failures=0
[ "$rc" -eq 4 ] || { echo "FAIL: exit $rc, not 4"; failures=$((failures + 1)); }
grep -q "mlacp launch: rank 1 is stopped (process state T" "$work/out" \
  || { echo "FAIL: the launcher did not name the stopped rank 1"; failures=$((failures + 1)); }
[ "$took" -le 20 ] || { echo "FAIL: took ${took}s with --timeout 5"; failures=$((failures + 1)); }
sleep 0.5
pgrep -f "$work/marker.json" >/dev/null && { echo "FAIL: processes left"; failures=$((failures + 1)); }
if [ "$failures" -eq 0 ]; then echo PASS; else exit 1; fi
