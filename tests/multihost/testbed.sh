# The multi-host test bed (sourced by the tests in this folder; docs/DESIGN.md §2 "Several hosts").
# Two hosts are two network namespaces joined by a veth pair, with addresses of the test's own
# (10.233.0.1 and 10.233.0.2 on a /24 that exists only between them: nothing leaves them), the link
# shaped with tc (tbf: a rate and a burst; this kernel has no netem for delay). Ranks run in them
# with torchrun's variables, as torchrun sets them on two nodes. Everything the bed makes (the
# namespaces, the link, the processes in them) is removed on every exit path of the test (EXIT,
# INT, TERM traps); a test that cannot make namespaces (not root, no `ip netns`) exits 77: CTest's
# skip, with the reason.
#
#   source testbed.sh
#   testbed_up                      # hosts a (10.233.0.1) and b (10.233.0.2), unshaped
#   testbed_shape 1gbit             # tbf on both ends of the link
#   testbed_begin 1gbit             # both, and a work folder $TB_WORK for the logs
#   testbed_rank a 0 0 -- CMD...    # rank 0, local rank 0 on host a, in the background; $! is its pid
#   testbed_link down|up            # the link between the hosts
#   testbed_down                    # also run by the trap
set -u
TB_ID="mlacp$$"
TB_NS_A="${TB_ID}-a"
TB_NS_B="${TB_ID}-b"
TB_IF_A="mx$(( $$ % 100000 ))a"
TB_IF_B="mx$(( $$ % 100000 ))b"
TB_ADDR_A=10.233.0.1
TB_ADDR_B=10.233.0.2
TB_PORT=$(( 20000 + RANDOM % 20000 ))
TB_LOCAL=${TB_LOCAL:-2}   # ranks a host (2 hosts)
TB_PIDS=()
TB_UP=0

testbed_skip_unless_able() {
  if [ "$(id -u)" -ne 0 ]; then echo "SKIP: the multi-host test bed needs root (network namespaces)"; exit 77; fi
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "SKIP: the multi-host test bed needs ip and tc (iproute2)"; exit 77
  fi
  if ! ip netns add "${TB_ID}-probe" 2>/dev/null; then echo "SKIP: network namespaces cannot be made here"; exit 77; fi
  ip netns del "${TB_ID}-probe"
}

testbed_down() {
  local pid
  for pid in "${TB_PIDS[@]}"; do kill -KILL -- "-$pid" "$pid" 2>/dev/null; done
  for ns in "$TB_NS_A" "$TB_NS_B"; do
    if ip netns list 2>/dev/null | grep -q "^$ns\b"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    fi
  done
  ip link del "$TB_IF_A" 2>/dev/null
  TB_PIDS=()
  TB_UP=0
}

testbed_up() {
  testbed_skip_unless_able
  trap 'testbed_down' EXIT
  trap 'testbed_down; exit 130' INT
  trap 'testbed_down; exit 143' TERM
  ip netns add "$TB_NS_A" && ip netns add "$TB_NS_B" &&
    ip link add "$TB_IF_A" type veth peer name "$TB_IF_B" &&
    ip link set "$TB_IF_A" netns "$TB_NS_A" && ip link set "$TB_IF_B" netns "$TB_NS_B" &&
    ip -n "$TB_NS_A" addr add "$TB_ADDR_A/24" dev "$TB_IF_A" && ip -n "$TB_NS_B" addr add "$TB_ADDR_B/24" dev "$TB_IF_B" &&
    ip -n "$TB_NS_A" link set lo up && ip -n "$TB_NS_B" link set lo up &&
    ip -n "$TB_NS_A" link set "$TB_IF_A" up && ip -n "$TB_NS_B" link set "$TB_IF_B" up ||
    { echo "FAIL: the test bed could not be made"; exit 1; }
  TB_UP=1
}

# testbed_begin RATE: the usual start of a test: the two hosts, the link shaped to RATE, a work
# folder $TB_WORK (removed with the rest on exit) where the ranks' logs go.
testbed_begin() {
  testbed_up
  testbed_shape "$1"
  TB_WORK=$(mktemp -d)
  TB_LOG_DIR="$TB_WORK"
  trap 'testbed_down; rm -rf "$TB_WORK"' EXIT
}

# testbed_shape RATE: both directions through a token bucket (e.g. 1gbit, 200mbit).
testbed_shape() {
  local rate="$1"
  for end in "$TB_NS_A $TB_IF_A" "$TB_NS_B $TB_IF_B"; do
    set -- $end
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$rate" burst 256kb latency 100ms ||
      { echo "FAIL: tc could not shape the link"; exit 1; }
  done
}

testbed_link() {
  ip -n "$TB_NS_A" link set "$TB_IF_A" "$1"
  ip -n "$TB_NS_B" link set "$TB_IF_B" "$1"
}

testbed_ns() { [ "$1" = a ] && echo "$TB_NS_A" || echo "$TB_NS_B"; }
testbed_node() { [ "$1" = a ] && echo 0 || echo 1; }

# testbed_rank HOST RANK LOCAL_RANK -- CMD...: one rank in its own process group, in the
# background, with torchrun's variables for a 2-node world of TB_LOCAL ranks a node (2 by
# default); stdout+stderr to $TB_LOG_DIR/rank<RANK>.log when TB_LOG_DIR is set. Each host has a core
# of its own where the machine has two (a: CPU 0, b: CPU 1; its ranks share it), as two machines
# would not share their cores. Sets TB_LAST_PID.
testbed_rank() {
  local host="$1" rank="$2" local_rank="$3"
  shift 4
  local log=/dev/null cores=()
  [ -n "${TB_LOG_DIR:-}" ] && log="$TB_LOG_DIR/rank$rank.log"
  if [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then cores=(taskset -c "$(testbed_node "$host")"); fi
  ip netns exec "$(testbed_ns "$host")" env RANK="$rank" WORLD_SIZE="$((2 * TB_LOCAL))" LOCAL_RANK="$local_rank" \
    LOCAL_WORLD_SIZE="$TB_LOCAL" GROUP_RANK="$(testbed_node "$host")" MASTER_ADDR="$TB_ADDR_A" MASTER_PORT="$TB_PORT" \
    setsid "${cores[@]}" "$@" >"$log" 2>&1 &
  TB_LAST_PID=$!
  TB_PIDS+=("$TB_LAST_PID")
}

# testbed_world CMD...: ranks 0..TB_LOCAL-1 on host a, the next TB_LOCAL on host b; waits for them;
# prints each rank's exit code as "rank R: exit C" and returns the largest.
testbed_world() {
  local pids=() worst=0 r rc n=$((2 * TB_LOCAL))
  for ((r = 0; r < n; ++r)); do
    local host=a
    [ "$r" -ge "$TB_LOCAL" ] && host=b
    testbed_rank "$host" "$r" $((r % TB_LOCAL)) -- "$@"
    pids+=("$TB_LAST_PID")
  done
  for ((r = 0; r < n; ++r)); do
    wait "${pids[$r]}"; rc=$?
    echo "rank $r: exit $rc"
    [ "$rc" -gt "$worst" ] && worst=$rc
  done
  return "$worst"
}
