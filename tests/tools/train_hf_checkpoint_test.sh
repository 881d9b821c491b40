#!/usr/bin/env bash
# `mlacp train --hf-checkpoint DIR`: training starts from a HuggingFace checkpoint's weights (a
# dense decoder of the "test" preset shapes, vocab 256, bf16, 2 shards) on 2 CP ranks and says
# what it loaded; its first loss is the single-process one from the same weights, not the random
# draw's; conflicting or broken invocations end in one clear mlacp error before any rank starts
# (exit 2, no "[rank r]" output, no LibTorch stack trace).
# Usage: train_hf_checkpoint_test.sh MLACP WRITE_TEST_CHECKPOINT
set -u
mlacp="$(realpath "$1")"
writer="$(realpath "$2")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$writer" "$work/ckpt" --decoder >/dev/null || { echo "FAIL: could not write the test checkpoint"; exit 1; }
"$writer" "$work/vocab1000" --decoder --vocab 1000 >/dev/null || { echo "FAIL: could not write the vocab checkpoint"; exit 1; }

small=(--seq 64 --warmup 1 --timeout 60)
first_loss() { sed -n '1s/.*"loss":\([^,}]*\).*/\1/p' "$1"; }

out=$(cd "$work" && timeout 120 "$mlacp" train --nproc 2 --cp 2 --hf-checkpoint "$work/ckpt" --steps 3 \
      "${small[@]}" --log "$work/cp.jsonl" 2>&1); rc=$?
if [ "$rc" -ne 0 ] || ! grep -qF "train: initialised from $work/ckpt: 27 tensors, 2 layers" <<<"$out" \
   || ! grep -q "train: 3 steps (1-3)" <<<"$out"; then
  fail "train --nproc 2 --cp 2 --hf-checkpoint (exit $rc)"; echo "$out" | tail -8 | sed 's/^/    /'
fi
(cd "$work" && timeout 60 "$mlacp" train --nproc 1 --hf-checkpoint "$work/ckpt" --steps 1 "${small[@]}" \
   --log "$work/single.jsonl" >/dev/null 2>&1) || fail "train --nproc 1 --hf-checkpoint"
(cd "$work" && timeout 60 "$mlacp" train --nproc 1 --config "$work/ckpt/config.json" --steps 1 "${small[@]}" \
   --log "$work/scratch.jsonl" >/dev/null 2>&1) || fail "train --nproc 1 --config DIR/config.json"
cp_loss=$(first_loss "$work/cp.jsonl"); single_loss=$(first_loss "$work/single.jsonl")
scratch_loss=$(first_loss "$work/scratch.jsonl")
rel_close() {  # rel_close A B TOL: |A - B| <= TOL * |B|
  awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; s = b < 0 ? -b : b; exit !(d <= t * s) }'
}
if [ -z "$cp_loss" ] || [ -z "$single_loss" ] || [ -z "$scratch_loss" ]; then
  fail "a run wrote no loss (cp='$cp_loss' single='$single_loss' scratch='$scratch_loss')"
else
  rel_close "$cp_loss" "$single_loss" 1e-4 \
    || fail "step 1: cp=2 loss $cp_loss is not the single-process loss $single_loss"
  rel_close "$single_loss" "$scratch_loss" 1e-3 \
    && fail "step 1: the checkpoint's loss $single_loss equals the random draw's $scratch_loss"
fi

row() {  # row "expected text" args...
  local expected="$1"; shift
  local out rc
  out=$(cd "$work" && timeout 60 "$mlacp" train "$@" 2>&1); rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "^mlacp: " <<<"$out" || ! grep -qF -- "$expected" <<<"$out" \
     || grep -q "\[rank \|Exception raised from\|frame #" <<<"$out"; then
    fail "(exit $rc): mlacp train $*"; echo "$out" | tail -5 | sed 's/^/    /'
  fi
}
shape="--preset, --config and --layers cannot go with it"
row "$shape" --nproc 2 --hf-checkpoint "$work/ckpt" --preset test --steps 1
row "$shape" --nproc 2 --hf-checkpoint "$work/ckpt" --config "$work/ckpt/config.json" --steps 1
row "$shape" --nproc 2 --hf-checkpoint "$work/ckpt" --layers 1 --steps 1
row "it cannot go with --resume" --nproc 2 --hf-checkpoint "$work/ckpt" --checkpoint "$work/run" --resume --steps 1
row "mlacp train trains a byte-level model" --nproc 2 --hf-checkpoint "$work/vocab1000" --steps 1
row "mlacp verify --checkpoint DIR" --nproc 2 --hf-checkpoint "$work/vocab1000" --steps 1
row "vocab_size=1000" --nproc 2 --config "$work/vocab1000/config.json" --steps 1
row "--hf-checkpoint: must name a readable folder" --nproc 2 --hf-checkpoint "$work/missing" --steps 1
[ "$failures" -eq 0 ] && echo PASS || { echo "$failures check(s) failed"; exit 1; }
