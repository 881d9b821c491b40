#!/usr/bin/env bash
# mlacp train --compare across two hosts x two ranks (testbed.sh, 1 Gbit/s), ranks started with
# torchrun's variables: the ranks train the layout (Ulysses inside the hosts by default), rank 0
# then trains the same steps alone; the loss curves agree.
# Usage: train_test.sh MLACP
set -u
mlacp="$(realpath "$1")"
source "$(dirname "$0")/testbed.sh"
testbed_begin 1gbit
work="$TB_WORK"
testbed_world "$mlacp" --threads 1 train --compare --steps 20 --out "$work/compare" --timeout 60
rc=$?
grep -E "^train: world|loss curves|^dp=|^single" "$work/rank0.log"
if [ "$rc" -eq 0 ] && grep -q "loss curves: .*: agree" "$work/rank0.log" &&
   grep -q "the Ulysses all-to-alls stay inside hosts, the all-gathers cross hosts" "$work/rank0.log"; then
  echo PASS
else
  echo "FAIL: exit $rc"; tail -5 "$work/rank0.log"; exit 1
fi
