#!/usr/bin/env bash
# torchrun --nnodes 2 across two hosts (testbed.sh: two network namespaces, a 1 Gbit/s link), one
# torchrun per host with 2 ranks each, as a user starts a two-node job:
#   torchrun --nnodes 2 --node_rank N --nproc_per_node 2 --master_addr 10.233.0.1 --master_port P ...
#   1. the Python package with HuggingFace DeepSeek models: hf_parity_torchrun.py (the parity cases of
#      test_hf_parity.py on the 4 ranks, Ulysses groups of the hybrid inside the hosts);
#   2. the README's example for two hosts: examples/hf_context_parallel.py as it is (losses agree);
#   3. the C++ tool under torchrun (--no-python): verify's representative matrix (the ranks read
#      torchrun's variables, connect to its agent's store, bind the interface that reaches
#      MASTER_ADDR).
# GLOO_SOCKET_IFNAME names each host's interface for torch.distributed's own groups (c10d binds
# the interface its host name resolves to otherwise: on these namespace hosts, no usable one);
# the C++ tool finds it by the route to MASTER_ADDR. Needs torchrun on PATH.
# Usage: torchrun_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/testbed.sh"
command -v torchrun >/dev/null || { echo "FAIL: torchrun is not on PATH"; exit 1; }
testbed_begin 1gbit
work="$TB_WORK"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# two_nodes NAME TIMEOUT [ENV=VALUE ...] -- ARGS...: one torchrun per host; each host's output in
# $work/NAME-<host>.log; returns the worse exit code
two_nodes() {
  local name="$1" limit="$2"
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local pids=() rc worst=0 port=$(( 20000 + RANDOM % 20000 ))
  for host in a b; do
    local iface="$TB_IF_A"
    [ "$host" = b ] && iface="$TB_IF_B"
    ip netns exec "$(testbed_ns "$host")" env GLOO_SOCKET_IFNAME="$iface" OMP_NUM_THREADS=1 "${envs[@]}" \
      timeout "$limit" setsid torchrun --nnodes 2 --node_rank "$(testbed_node "$host")" --nproc_per_node 2 \
      --master_addr "$TB_ADDR_A" --master_port "$port" "$@" >"$work/$name-$host.log" 2>&1 &
    pids+=($!)
    TB_PIDS+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid"; rc=$?
    [ "$rc" -gt "$worst" ] && worst=$rc
  done
  return "$worst"
}

two_nodes hf 600 -- "$here/hf_parity_torchrun.py"
rc=$?
grep -E "^(latent|expanded)|PASS" "$work/hf-a.log"
[ "$rc" -eq 0 ] && grep -q "hf parity on 4 ranks (2 a host, node 0 leading.*): PASS" "$work/hf-a.log" ||
  { fail "HuggingFace parity under torchrun --nnodes 2 (exit $rc)"; tail -20 "$work/hf-a.log" "$work/hf-b.log"; }

# The README's example for two hosts: the single-host example script, unchanged, on 2 x 2 ranks
two_nodes example 300 -- "$here/../../examples/hf_context_parallel.py"
rc=$?
grep -E "losses agree" "$work/example-a.log"
[ "$rc" -eq 0 ] && grep -q "losses agree: True" "$work/example-a.log" ||
  { fail "examples/hf_context_parallel.py under torchrun --nnodes 2 (exit $rc)"; tail -20 "$work/example-a.log"; }

# The C++ tool: torchrun's GLOO_SOCKET_IFNAME is not needed by it (unset for this run).
two_nodes tool 300 GLOO_SOCKET_IFNAME= -- --no-python "$mlacp" --threads 1 verify --timeout 60
rc=$?
grep -E "^verify: " "$work/tool-a.log"
[ "$rc" -eq 0 ] && grep -q "^verify: all .* passed" "$work/tool-a.log" &&
  grep -q "^verify: 2 hosts: 10.233.0.1 (node 0) ranks \[0, 1\] | 10.233.0.2 (node 1) ranks \[2, 3\]" "$work/tool-a.log" ||
  { fail "mlacp verify under torchrun --nnodes 2 (exit $rc)"; tail -20 "$work/tool-a.log" "$work/tool-b.log"; }

if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
