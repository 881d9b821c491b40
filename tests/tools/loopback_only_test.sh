#!/usr/bin/env bash
# A local multi-rank run (--nproc) listens on no network address but loopback: the ranks meet
# over a FileStore (no rendezvous port) and Gloo binds 127.0.0.1. Checked from the sockets the
# launcher and its ranks hold while they run (/proc/PID/fd against /proc/net/tcp and tcp6).
# Usage: loopback_only_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
work=$(mktemp -d)
pid=0 t0=0 t1=0
trap 'kill -KILL -- "-$pid" "$t0" "$t1" 2>/dev/null; rm -rf "$work"' EXIT
cases=()
for _ in $(seq 400); do cases+=(latent-p2-u2-head_tail); done
# listeners MARKER: the local addresses (hex) of listening TCP sockets held by processes whose
# command line contains MARKER; "none" when they hold sockets but none listens.
listeners() {
  local inodes
  inodes=$(for p in $(pgrep -f "$1"); do
             ls -l "/proc/$p/fd" 2>/dev/null | sed -n 's/.*socket:\[\([0-9]*\)\].*/\1/p'
           done | sort -u)
  [ -n "$inodes" ] || { echo "nosockets"; return; }
  # /proc/net/tcp{,6}: local address in column 2, state 0A = LISTEN, inode in column 10.
  local found
  found=$(awk -v inodes=" $(echo $inodes) " '$4 == "0A" && index(inodes, " " $10 " ") { print $2 }' \
          /proc/net/tcp /proc/net/tcp6)
  echo "${found:-none}"
}
loopback='^(0100007F|0000000000000000FFFF00000100007F|00000000000000000000000001000000):'

# 1. A local run: sockets (Gloo's connections), no listener off loopback.
(cd "$work" && exec setsid "$mlacp" verify --nproc 2 --case "${cases[@]}" --json "$work/local.json" \
   >"$work/out" 2>&1) &
pid=$!
for _ in $(seq 100); do grep -q "\[5/" "$work/out" 2>/dev/null && break; sleep 0.1; done
grep -q "\[5/" "$work/out" || { echo "FAIL: the ranks never started their cases"; tail -5 "$work/out"; exit 1; }
local_listeners=$(listeners "$work/local.json")
kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null
echo "local run (--nproc 2), listening sockets: $(echo $local_listeners)"
[ "$local_listeners" != "nosockets" ] || { echo "FAIL: no sockets found: the check would prove nothing"; exit 1; }
if [ "$local_listeners" != "none" ] && grep -v -E "$loopback" <<<"$local_listeners" | grep -q .; then
  echo "FAIL: a local run listens on a non-loopback address"; exit 1
fi

# 2. The detector sees the listener where there is one: torchrun-style ranks, whose rank 0 serves
#    the TCPStore on MASTER_PORT. With a PyTorch 2.x LibTorch it listens on MASTER_ADDR only (here
#    127.0.0.1: mlacp hands c10d the socket); LibTorch 1.13's listens on every interface (README:
#    what listens where).
port=$(( 20000 + RANDOM % 20000 ))
for r in 0 1; do
  env RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    setsid "$mlacp" verify --case "${cases[@]}" --json "$work/torchrun$r.json" >"$work/t$r.out" 2>&1 &
  eval "t$r=\$!"
done
for _ in $(seq 100); do grep -q "\[5/" "$work/t0.out" 2>/dev/null && break; sleep 0.1; done
store_listeners=$(listeners "$work/torchrun0.json")
kill -KILL "$t0" "$t1" 2>/dev/null; wait 2>/dev/null
echo "torchrun-style rank 0, listening sockets: $(echo $store_listeners)"
store=$(grep -E ":$(printf '%04X' "$port")\$" <<<"$store_listeners")
[ -n "$store" ] || { echo "FAIL: the TCPStore's listener on MASTER_PORT $port was not seen: the check is blind"; exit 1; }
libtorch=$("$mlacp" info --skip-gemm 2>/dev/null | sed -n 's/^LibTorch *//p')
echo "the store (MASTER_PORT $port) listens on $store with LibTorch $libtorch"
if [ "${libtorch%%.*}" -ge 2 ] && ! grep -q -E "$loopback" <<<"$store"; then
  echo "FAIL: with LibTorch $libtorch the store must listen on MASTER_ADDR (127.0.0.1) only"; exit 1
fi
echo PASS
