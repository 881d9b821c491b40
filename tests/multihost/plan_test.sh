#!/usr/bin/env bash
# The planner on two hosts (testbed.sh; 2 hosts x 2 ranks, the link shaped to RATE, 1gbit by
# default): this machine's compute calibrated once (`mlacp plan --calibrate`), the links inside a
# host and across hosts calibrated on the real network (`mlacp plan --calibrate-link`, every rank),
# then for each S every strategy x U x overlap measured across the hosts (`mlacp bench`, no emulated
# link) and predicted (`mlacp plan --hardware` the calibrated file): the bytes of every transfer
# equal, the predicted step's error (median, worst), and whether the planner's choice measures
# within 10% of the fastest configuration (a miss is timed again, the choice and the fastest one
# after the other with 5 steps, and judged on those: 3-step medians on shared cores can swap two
# configurations a few percent apart). The hosts share this machine's cores: one each
# (testbed.sh), which the link calibration writes as cores_per_node.
# Usage: plan_test.sh MLACP [OUT_DIR] [S,S,...]   (default S = 1024; RATE=200mbit for a slower link)
# PLAN_CHECK_MEDIAN=0.35 fails the run (exit 1) when the median error exceeds it or the choice
# misses (the suite's loose bound: its timings are noisy; the README has the measured figures).
set -u
mlacp="$(realpath "$1")"
out="${2:-$(mktemp -d)}"
seqs="${3:-1024}"
source "$(dirname "$0")/testbed.sh"
mkdir -p "$out"
model=(--hidden 1024 --heads 16 --q-rank 1536 --kv-rank 512 --nope 128 --rope 64 --value 128)
"$mlacp" plan --calibrate --preset tiny "${model[@]}" --dtype float32 --seq 1024 --cp 4 --calibrate-seq 1024 \
  --save-hardware "$out/host.json" >"$out/calibrate-host.log" 2>&1 || { echo "FAIL: host calibration"; exit 1; }
testbed_up
testbed_shape "${RATE:-1gbit}"
TB_LOG_DIR="$out"
testbed_world "$mlacp" --threads 1 plan --calibrate-link --hardware "$out/host.json" --save-hardware "$out/hosts.json" \
  --preset tiny "${model[@]}" --dtype float32 --seq 1024 --cp 4 >/dev/null || { echo "FAIL: link calibration"; exit 1; }
grep "^calibrate:" "$out/rank0.log"
for s in ${seqs//,/ }; do
  "$mlacp" plan --hardware "$out/hosts.json" --preset tiny "${model[@]}" --dtype float32 --seq "$s" --cp 4 \
    --partition head_tail --json "$out/plan-S$s.json" >"$out/plan-S$s.txt" || { echo "FAIL: plan S=$s"; exit 1; }
  for u in 1 2 4; do
    testbed_world "$mlacp" --threads 1 bench --no-pin --seq "$s" --ulysses "$u" "${model[@]}" --dtype float32 \
      --steps 3 --warmup 1 --timeout 300 --json "$out/bench-S$s-U$u.json" >/dev/null ||
      { echo "FAIL: bench S=$s U=$u"; tail -3 "$out/rank0.log"; exit 1; }
  done
done
# judge.py FIRST|FINAL: FIRST prints the table and writes recheck.txt with the two configurations
# (choice, fastest) of every S whose choice missed; FINAL judges those on the recheck's timings.
cat >"$out/judge.py" <<'PY'
import json, os, statistics, sys
out, seqs, phase = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
errors, misses, lines, recheck = [], 0, [], []
name = lambda k: f"{k[0]} U={k[1]} overlap {'on' if k[2] else 'off'}"
for s in seqs:
    plan = json.load(open(f"{out}/plan-S{s}.json"))
    predicted = {(c["strategy"], c["ulysses"], c["overlap"]): c for c in plan["candidates"] if c["feasible"]}
    chosen = plan["candidates"][plan["chosen"]]
    measured = {}
    for u in (1, 2, 4):
        for row in json.load(open(f"{out}/bench-S{s}-U{u}.json"))["rows"]:
            if "median_step_ms" in row:
                key = (row["strategy"], u, row["overlap"])
                c = predicted[key]
                for label, b in row["bytes_by_label"].items():
                    want = c.get("transfers", {}).get(label, {}).get("bytes")
                    if want != b:
                        sys.exit(f"FAIL: bytes of {label} for {key} at S={s}: bench {b}, plan {want}")
                measured[key] = row["median_step_ms"]
                e = abs(c["step_s"] * 1e3 - row["median_step_ms"]) / row["median_step_ms"]
                errors.append(e)
                lines.append(f"S={s} {key[0]:16s} U={u} overlap {'on ' if key[2] else 'off'}: measured "
                             f"{row['median_step_ms']:7.1f} ms, predicted {c['step_s'] * 1e3:7.1f} ms ({e:+.0%})")
    fastest = min(measured, key=measured.get)
    key = (chosen["strategy"], chosen["ulysses"], chosen["overlap"])
    ok = measured[key] <= 1.10 * measured[fastest]
    lines.append(f"S={s}: planner's choice {name(key)} measured {measured[key]:.1f} ms; fastest {name(fastest)} "
                 f"{measured[fastest]:.1f} ms -> {'ok' if ok else 'MISS'}")
    if not ok and phase == "FINAL":
        # A 3-step median on shared cores can swap two configurations a few percent apart: the pair
        # was timed again, one after the other, with more steps; a wrong choice misses there too.
        again = {}
        for k in (key, fastest):
            for row in json.load(open(f"{out}/recheck-S{s}-{k[0]}-U{k[1]}.json"))["rows"]:
                if "median_step_ms" in row and row["overlap"] == k[2]:
                    again[k] = row["median_step_ms"]
        ok = again[key] <= 1.10 * again[fastest]
        lines.append(f"S={s}: timed again: choice {again[key]:.1f} ms, {name(fastest)} {again[fastest]:.1f} ms "
                     f"-> {'ok' if ok else 'MISS'}")
    elif not ok:
        recheck += [f"{s} {key[0]} {key[1]}", f"{s} {fastest[0]} {fastest[1]}"]
    misses += not ok
print("\n".join(lines))
if phase == "FIRST":
    open(f"{out}/recheck.txt", "w").write("".join(f"{r}\n" for r in dict.fromkeys(recheck)))
    if recheck: sys.exit(0)
print(f"plan on two hosts: {len(errors)} configurations, predicted step error median {statistics.median(errors):.1%}, "
      f"worst {max(errors):.1%}; choice within 10% of the fastest in {len(seqs) - misses}/{len(seqs)}")
json.dump({"median_error": statistics.median(errors), "worst_error": max(errors), "misses": misses,
           "lines": lines}, open(f"{out}/summary.json", "w"), indent=1)
bound = os.environ.get("PLAN_CHECK_MEDIAN")
if bound and (statistics.median(errors) > float(bound) or misses):
    sys.exit(f"FAIL: median error {statistics.median(errors):.1%} (bound {float(bound):.0%}), {misses} missed choice(s)")
print("PASS")
PY
python3 "$out/judge.py" "$out" "$seqs" FIRST || exit 1
[ -s "$out/recheck.txt" ] || exit 0
while read -r s strategy u <&3; do
  testbed_world "$mlacp" --threads 1 bench --no-pin --seq "$s" --ulysses "$u" --strategy "$strategy" "${model[@]}" \
    --dtype float32 --steps 5 --warmup 1 --timeout 300 --json "$out/recheck-S$s-$strategy-U$u.json" >/dev/null ||
    { echo "FAIL: bench again S=$s $strategy U=$u"; tail -3 "$out/rank0.log"; exit 1; }
done 3<"$out/recheck.txt"
python3 "$out/judge.py" "$out" "$seqs" FINAL
