#!/usr/bin/env bash
# `mlacp verify --checkpoint DIR`: the CP check with a HuggingFace checkpoint's config and one
# layer's attention weights passes on 2 ranks; broken or conflicting invocations end in one clear
# mlacp error before any rank starts (no "[rank r]" output, no LibTorch stack trace).
# Usage: checkpoint_verify_test.sh MLACP WRITE_TEST_CHECKPOINT
set -u
mlacp="$(realpath "$1")"
writer="$(realpath "$2")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

"$writer" "$work/ckpt" >/dev/null || { echo "FAIL: could not write the test checkpoint"; exit 1; }
"$writer" "$work/fp8" --fp8 >/dev/null || { echo "FAIL: could not write the fp8 checkpoint"; exit 1; }

# Layer 0 in float64 (the default), layer 1 under bf16 autocast with the other strategy.
ok() {  # ok "description" args...
  local what="$1"; shift
  local out rc
  out=$(cd "$work" && timeout 240 "$mlacp" verify --nproc 2 "$@" 2>&1); rc=$?
  if [ "$rc" -ne 0 ] || ! grep -q "verify: all .* checks of 1 cases passed" <<<"$out"; then
    fail "$what (exit $rc): mlacp verify --nproc 2 $*"; echo "$out" | tail -8 | sed 's/^/    /'
  fi
}
ok "layer 0, float64" --checkpoint "$work/ckpt" --json "$work/layer0.json"
grep -q "weights=checkpoint $work/ckpt layer 0" "$work/layer0.json" \
  || fail "the --json description does not name the checkpoint's weights"
grep -q "checkpoint-layer0: .*heads=4 hidden=16 Rq=8 Rkv=6 Dn=4 Dr=2 Dv=3" "$work/layer0.json" \
  || fail "the case does not have the checkpoint's config"
ok "layer 1, bf16, expanded" --checkpoint "$work/ckpt" --layer 1 --dtype bfloat16 --strategy expanded_ulysses

row() {  # row "expected text" args...
  local expected="$1"; shift
  local out rc
  out=$(cd "$work" && timeout 60 "$mlacp" verify "$@" 2>&1); rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "^mlacp: " <<<"$out" || ! grep -qF -- "$expected" <<<"$out" \
     || grep -q "\[rank \|Exception raised from\|frame #" <<<"$out"; then
    fail "(exit $rc): mlacp verify $*"; echo "$out" | tail -5 | sed 's/^/    /'
  fi
}
row "--preset and --config cannot go with it" --nproc 2 --checkpoint "$work/ckpt" --preset tiny
row "--preset and --config cannot go with it" --nproc 2 --checkpoint "$work/ckpt" --config "$work/ckpt/config.json"
row "fixes the layer's shape" --nproc 2 --checkpoint "$work/ckpt" --heads 8
row "--layer needs --checkpoint" --nproc 2 --layer 1
row "the layer index is outside the model; got layer=2, num_hidden_layers=2" --nproc 2 --checkpoint "$work/ckpt" --layer 2
row "tensor=model.layers.0.self_attn.kv_b_proj.weight, dtype=F8_E4M3; dequantise to bf16 first" \
    --nproc 2 --checkpoint "$work/fp8"
row "--checkpoint: must name a readable folder" --nproc 2 --checkpoint "$work/missing"
row "--single-device takes only --case names" --single-device --checkpoint "$work/ckpt"
# Layer 1 of the fp8 checkpoint is bf16: it loads.
ok "bf16 layer of an otherwise fp8 checkpoint" --checkpoint "$work/fp8" --layer 1
[ "$failures" -eq 0 ] && echo PASS || { echo "$failures check(s) failed"; exit 1; }
