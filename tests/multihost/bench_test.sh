#!/usr/bin/env bash
# mlacp bench over a real network stack: two hosts (testbed.sh) joined by a link shaped to 1 Gbit/s
# (tbf), no emulated link. Two layouts: one rank a host, U = 2 (both strategies' all-to-alls cross
# the link: what it carries is what overlap must hide), and two ranks a host with the default U
# (the all-to-alls inside the hosts, the all-gathers across). Both strategies run their overlap
# schedules, and the test prints bench's figures: exposed communication, hidden %, the step time
# overlap saved, and per overlapped transfer its duration (its exposure with overlap off), the
# computation the schedule placed under it and its exposure with overlap on.
#
# What it holds: every overlapped transfer that fits under its computation (duration <= 0.75 of it)
# is >= 90% hidden (the sum over those transfers, 2 ms of slack), and each strategy has at least one
# such transfer. A transfer longer than the computation under it cannot be hidden by any schedule
# on this link (a host's one core also runs its transport): it is printed with its ratio, not held
# to 90%. Bench's own criteria (all transfers >= 90% hidden, >= 80% of overlap-off's exposure saved)
# depend on that ratio, i.e. on how fast this machine's core is against 1 Gbit/s: printed, and the
# README has the measured runs.
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
steps = {(row["strategy"], row["overlap"]): row for row in doc["rows"] if "overlap" in row}
PACKED = {"q": "qkv", "k": "qkv", "v": "qkv", "kv": "qkv", "dq": "dqkv", "dk": "dqkv", "dv": "dqkv", "dkv": "dqkv"}
bad = 0
for row in doc["rows"]:
    if "criteria_met" not in row:
        continue
    s = row["strategy"]
    print(f"{name}: {s}: overlapped {row['overlapped_labels']}: their comm "
          f"{row['overlapped_comm_ms']:.1f} ms, hidden {row['overlapped_hidden_percent']:.1f}%, exposed off "
          f"{row['overlapped_exposed_off_ms']:.1f} ms, step saved {row['step_saved_ms']:.1f} ms "
          f"({row['step_saved_percent_of_exposed_off']:.0f}%; paired {row['paired_step_saved_ms']:.1f} ms), "
          f"bench's criteria {'met' if row['criteria_met'] else 'not met'}")
    off, on = steps[(s, False)], steps[(s, True)]
    fit_duration = fit_exposed = 0.0
    fitting = []
    for label in row["overlapped_labels"].split(","):
        plain = label if label in off["bytes_by_label"] else PACKED.get(label, label)
        duration = off["exposed_ms_by_label"].get(plain, 0.0) * on["bytes_by_label"][label] / off["bytes_by_label"][plain]
        under = on["compute_under_ms_by_label"].get(label, 0.0)
        exposed = on["exposed_ms_by_label"].get(label, 0.0)
        ratio = duration / under if under > 0 else float("inf")
        fits = ratio <= 0.75
        print(f"  {label}: {duration:.1f} ms with overlap off, {under:.1f} ms of computation under it "
              f"(ratio {ratio:.2f}{'' if fits else ': longer than what can hide it'}), exposed {exposed:.1f} ms")
        if fits:
            fitting.append(label)
            fit_duration += duration
            fit_exposed += exposed
    if not fitting:
        print(f"FAIL: {name}: {s}: no overlapped transfer fits under its computation on this machine: nothing to hold")
        bad += 1
    elif fit_exposed > 0.1 * fit_duration + 2.0:
        print(f"FAIL: {name}: {s}: the transfers that fit under their computation ({','.join(fitting)}) are exposed "
              f"{fit_exposed:.1f} ms of {fit_duration:.1f} ms (> 10% + 2 ms)")
        bad += 1
for row in doc["rows"]:
    if "overlap" in row and not row["overlap"]:
        print(f"{name}: {row['strategy']} overlap off: step {row['median_step_ms']:.0f} ms, comm {row['comm_ms']:.1f} ms "
              f"exposed; bytes {row['bytes_all_to_all'] + row['bytes_all_gather'] + row['bytes_reduce_scatter']} = "
              f"formula {row['formula_bytes']:.0f}")
        if row["bytes_all_to_all"] + row["bytes_all_gather"] + row["bytes_reduce_scatter"] != round(row["formula_bytes"]):
            print(f"FAIL: {name}: {row['strategy']}: the bytes moved differ from the formula")
            bad += 1
sys.exit(1 if bad else 0)
PY
}
layout "1-rank-a-host-U2" 1 --ulysses 2
layout "2-ranks-a-host" 2
rm -rf "$work"
if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
