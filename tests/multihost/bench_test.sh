#!/usr/bin/env bash
# mlacp bench over a real network stack: two hosts (testbed.sh) joined by a link shaped to 1 Gbit/s
# (tbf), no emulated link. Two layouts: one rank a host, U = 2 (both strategies' all-to-alls cross
# the link: what it carries is what overlap must hide), and two ranks a host with the default U
# (the all-to-alls inside the hosts, the all-gathers across). Both strategies run their overlap
# schedules; the test holds the overlapped transfers >= 90% hidden (bench's first criterion) and
# prints bench's figures: exposed communication, hidden %, the step time overlap saved. The
# second criterion (saved >= 80% of the exposed time with overlap off) is a difference of noisy
# step medians; it is printed, the README has the measured runs.
# Usage: bench_test.sh MLACP [OUT_DIR]
set -u
mlacp="$(realpath "$1")"
out="${2:-}"
source "$(dirname "$0")/testbed.sh"
work=$(mktemp -d)
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

layout() {  # layout NAME RANKS_A_HOST ARGS...
  local name="$1"
  TB_LOCAL="$2"
  shift 2
  testbed_up
  trap 'testbed_down; rm -rf "$work"' EXIT
  testbed_shape 1gbit
  TB_LOG_DIR="$work"
  testbed_world "$mlacp" --threads 1 bench --no-pin --seq 1024 --steps 7 --warmup 2 --timeout 120 \
    --json "$work/$name.json" "$@" >/dev/null || { fail "$name: bench failed"; tail -5 "$work/rank0.log"; }
  testbed_down
  [ -n "$out" ] && mkdir -p "$out" && cp "$work/$name.json" "$work/rank0.log" "$out/" 2>/dev/null &&
    mv "$out/rank0.log" "$out/$name.log"
  python3 - "$work/$name.json" "$name" <<'PY' || failures=$((failures + 1))
import json, sys
doc, name = json.load(open(sys.argv[1])), sys.argv[2]
bad = 0
for row in doc["rows"]:
    if "criteria_met" not in row:
        continue
    print(f"{name}: {row['strategy']}: overlapped {row['overlapped_labels']}: their comm "
          f"{row['overlapped_comm_ms']:.1f} ms, hidden {row['overlapped_hidden_percent']:.1f}%, exposed off "
          f"{row['overlapped_exposed_off_ms']:.1f} ms, step saved {row['step_saved_ms']:.1f} ms "
          f"({row['step_saved_percent_of_exposed_off']:.0f}%; paired {row['paired_step_saved_ms']:.1f} ms), "
          f"bench's criteria {'met' if row['criteria_met'] else 'not met'}")
    if row["overlapped_hidden_percent"] < 90:
        print(f"FAIL: {name}: {row['strategy']} hid {row['overlapped_hidden_percent']:.1f}% < 90%")
        bad += 1
for row in doc["rows"]:
    if "overlap" in row and not row["overlap"]:
        print(f"{name}: {row['strategy']} overlap off: step {row['median_step_ms']:.0f} ms, comm {row['comm_ms']:.1f} ms "
              f"exposed; bytes {row['bytes_all_to_all'] + row['bytes_all_gather'] + row['bytes_reduce_scatter']} = "
              f"formula {row['formula_bytes']:.0f}")
sys.exit(1 if bad else 0)
PY
}
layout "1-rank-a-host-U2" 1 --ulysses 2
layout "2-ranks-a-host" 2
rm -rf "$work"
if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
