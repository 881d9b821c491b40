#!/usr/bin/env bash
# A training run killed (SIGKILL to every process, launcher and ranks) at many moments, saving a
# checkpoint after every step, and resumed each time: every resume starts from a complete
# checkpoint, and the log of the killed-and-resumed run is the uninterrupted run's, step for step
# (float64: equal to the digit), with no step missing or repeated. What the killed launchers left in
# $TMPDIR (rendezvous folders, progress logs) is gone after the last run (each launch removes what
# dead ones left).
# Usage: train_kill_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
work=$(mktemp -d)
export TMPDIR="$work/tmp"
mkdir "$TMPDIR"
trap '[ -n "${KEEP:-}" ] && echo "kept $work" || rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
steps=40
run=(train --nproc 2 --cp 2 --steps "$steps" --seq 64 --dtype float64 --warmup 1 --timeout 60)

(cd "$work" && timeout 300 "$mlacp" "${run[@]}" --log "$work/whole.jsonl" >/dev/null 2>&1) || fail "uninterrupted run"

# Kills spread over the run (startup, steps, saves); after each, resume (or start afresh while no
# checkpoint exists yet) and kill again; the last attempt runs to the end.
kills=0
for delay in 0.5 0.8 1.1 1.4 1.6 1.8 2.0 2.2 2.4 2.7 3.0 3.4; do
  resume=()
  ls -d "$work"/ckpt/step-* >/dev/null 2>&1 && resume=(--resume)
  (cd "$work" && exec setsid "$mlacp" "${run[@]}" --checkpoint "$work/ckpt" --checkpoint-every 1 \
     --log "$work/killed.jsonl" "${resume[@]}" >"$work/attempt.out" 2>&1) &
  pid=$!
  sleep "$delay"
  killed=0
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL -- "-$pid" 2>/dev/null; kills=$((kills + 1)); killed=1
  fi
  wait "$pid" 2>/dev/null; rc=$?
  if [ "$killed" -eq 0 ] && [ "$rc" -ne 0 ]; then
    fail "attempt ${resume[*]} before the kill at ${delay}s failed (exit $rc):"; tail -3 "$work/attempt.out" | sed 's/^/    /'
  fi
  sleep 0.2
  pgrep -f "$work/ckpt" >/dev/null && fail "processes left after the kill at ${delay}s"
done
resume=()
ls -d "$work"/ckpt/step-* >/dev/null 2>&1 && resume=(--resume)
out=$(cd "$work" && timeout 300 "$mlacp" "${run[@]}" --checkpoint "$work/ckpt" --checkpoint-every 1 \
      --log "$work/killed.jsonl" "${resume[@]}" 2>&1) || { fail "the final resume"; echo "$out" | tail -5; }
grep -q "resumed from .*step-[0-9]* (the newest complete checkpoint)" <<<"$out" || [ ${#resume[@]} -eq 0 ] \
  || fail "the resume does not say which checkpoint it took"

losses() { paste -d' ' <(grep -o '"step":[0-9]*' "$1") <(grep -o '"loss":[^,}]*' "$1"); }  # "step":N "loss":X per line
if ! diff <(losses "$work/whole.jsonl") <(losses "$work/killed.jsonl") >"$work/diff"; then
  fail "the killed-and-resumed log differs from the uninterrupted one:"; head -8 "$work/diff" | sed 's/^/    /'
fi
[ "$(losses "$work/whole.jsonl" | wc -l)" -eq "$steps" ] || fail "the uninterrupted log does not hold $steps steps"
[ "$(losses "$work/killed.jsonl" | cut -d' ' -f1 | tr '\n' ' ')" = "$(seq -f '"step":%g' 1 "$steps" | tr '\n' ' ')" ] \
  || fail "the log does not hold steps 1-$steps once each, in order"
left=$(ls -A "$TMPDIR")
[ -z "$left" ] || fail "killed launches left in \$TMPDIR: $left"
echo "kills: $kills, generations left: $(ls -A "$work/ckpt" | tr '\n' ' ')"
if [ "$failures" -eq 0 ]; then echo PASS; else echo "$failures failure(s)"; exit 1; fi
