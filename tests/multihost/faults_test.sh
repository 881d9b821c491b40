#!/usr/bin/env bash
# Faults across two hosts x two ranks (testbed.sh), each ending every surviving rank within
# --timeout + 5 s with an mlacp line naming what was lost, and no process left on either host:
#   1. a host that never joins: the ranks that came name the missing ranks and their node (exit 4);
#   2. one host's ranks SIGKILLed during training: each survivor names that host or a rank of its
#      own host that ended first, and one of them names that host (exit 4);
#   3. the link set down during training: each rank names the other host or a rank of its own host
#      that stalled on it, and on each host one names the other host (exit 4);
#   4. every rank bound to loopback (GLOO_SOCKET_IFNAME=lo): an input error on every rank before any
#      group connects (exit 2), where each host would dial its own loopback.
# None prints c10d's raw text or a stack trace.
# Usage: faults_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
source "$(dirname "$0")/testbed.sh"
testbed_begin 1gbit
work="$TB_WORK"
timeout_s=8
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
raw='frame #\|Exception raised from\|\[c10d\]\|Logging before InitGoogleLogging\|terminate called'

# start RANKS ARGS...: the given ranks (0-3), pids in `pids`
start() {
  local ranks="$1"
  shift
  pids=()
  for r in $ranks; do
    local host=a
    [ "$r" -ge 2 ] && host=b
    testbed_rank "$host" "$r" $((r % 2)) -- "$@"
    pids[$r]=$TB_LAST_PID
  done
}
# finish NAME RANKS WANT_EXIT WANT_TEXT: each rank's exit code and seconds since $t0, its mlacp line
finish() {
  local name="$1" ranks="$2" want="$3" text="$4" r rc
  for r in $ranks; do
    wait "${pids[$r]}"; rc=$?
    local took=$((SECONDS - t0)) line
    line=$(grep -m1 "^mlacp: " "$work/rank$r.log")
    echo "$name: rank $r exit $rc after ${took}s: ${line:0:220}"
    [ "$rc" -eq "$want" ] || fail "$name: rank $r exited $rc, not $want"
    [ "$took" -le $((timeout_s + 5)) ] || fail "$name: rank $r took ${took}s (bound: --timeout $timeout_s + 5 s)"
    grep -q -- "$text" <<<"$line" || fail "$name: rank $r did not say '$text'"
    ! grep -q "$raw" "$work/rank$r.log" || fail "$name: rank $r printed raw library text"
  done
}
# no_leftovers NAME: no process of the scenario is left on either host (called once every rank of
# the scenario has been waited for: a host whose ranks end later is not a leftover)
no_leftovers() {
  local name="$1" ns
  for ns in "$TB_NS_A" "$TB_NS_B"; do
    [ -z "$(ip netns pids "$ns")" ] || fail "$name: processes left on $ns: $(ip netns pids "$ns" | tr '\n' ' ')"
  done
}
# wait_steps N: until rank 0's --log holds N steps
wait_steps() {
  for _ in $(seq 300); do
    [ -s "$work/train.jsonl" ] && [ "$(wc -l <"$work/train.jsonl")" -ge "$1" ] && return 0
    sleep 0.1
  done
  fail "training never reached step $1"; tail -3 "$work/rank0.log"
  return 1
}
train=("$mlacp" --threads 1 train --cp 4 --steps 100000 --seq 256 --timeout "$timeout_s" --log "$work/train.jsonl")

# 1. host b never joins
start "0 1" "$mlacp" --threads 1 verify --timeout "$timeout_s"
t0=$SECONDS
finish "host b never joins" "0 1" 4 "missing_ranks=\[2, 3\], missing_nodes=\[1\]"
no_leftovers "host b never joins"

# 2. host b's ranks killed mid-training
rm -f "$work/train.jsonl"
start "0 1 2 3" "${train[@]}"
if wait_steps 3; then
  kill -KILL -- "-${pids[2]}" "-${pids[3]}"
  t0=$SECONDS
  wait "${pids[2]}" "${pids[3]}" 2>/dev/null
  # each survivor names host b itself, or says a rank of its own host closed first (a group whose
  # members all run on host a, e.g. the Ulysses pair, sees only its peer's exit); at least one names
  # host b
  finish "host b's ranks killed" "0 1" 4 \
    "lost_host=10.233.0.2 (node 1) world ranks\|=a rank of this host"
  grep -q "^mlacp: .*\(lost_host\|members_on_other_hosts\)=10.233.0.2 (node 1)" "$work/rank0.log" "$work/rank1.log" ||
    fail "host b's ranks killed: neither survivor named host b"
  no_leftovers "host b's ranks killed"
fi

# 3. the link down mid-training
rm -f "$work/train.jsonl"
start "0 1 2 3" "${train[@]}"
if wait_steps 3; then
  testbed_link down
  t0=$SECONDS
  # as above, a rank whose group runs only on its own host (the Ulysses pair) may time out on its
  # peer, itself blocked on the other host: it says a rank of its own host stalled; on each host at
  # least one rank names the other host
  finish "link down (host a's ranks)" "0 1" 4 \
    "lost_contact_with=10.233.0.2 (node 1) world ranks\|=a rank of this host"
  finish "link down (host b's ranks)" "2 3" 4 \
    "lost_contact_with=10.233.0.1 (node 0) world ranks\|=a rank of this host"
  grep -q "^mlacp: .*lost_contact_with=10.233.0.2 (node 1)" "$work/rank0.log" "$work/rank1.log" ||
    fail "link down: neither rank of host a named host b"
  grep -q "^mlacp: .*lost_contact_with=10.233.0.1 (node 0)" "$work/rank2.log" "$work/rank3.log" ||
    fail "link down: neither rank of host b named host a"
  no_leftovers "link down"
  testbed_link up
fi

# 4. every rank on loopback
start "0 1 2 3" env GLOO_SOCKET_IFNAME=lo "$mlacp" --threads 1 verify --timeout "$timeout_s"
t0=$SECONDS
finish "all on loopback" "0 1 2 3" 2 "ranks on several hosts must bind addresses the other hosts can reach, not loopback"
no_leftovers "all on loopback"

if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
