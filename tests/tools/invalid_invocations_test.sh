#!/usr/bin/env bash
# Invalid invocations end in a clear error: exit code 2 (invalid input) within seconds, an "mlacp:" line that
# names the rule, no LibTorch stack trace or log line, no unreadable number, no file left behind.
# (The hostile-input table; each row is one invocation and a text its message must contain.
# tests/tools/fuzz_invalid_options.py generates the rest from --help.)
set -u
mlacp="$(realpath "$1")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
touch "$work/a_file" "$work/empty.jsonl"
failures=0
row_env=()  # VAR=value words for the next row only (torchrun-style variables)
row() {  # row "expected text" args...
  local expected="$1"; shift
  local out rc
  out=$(cd "$work" && timeout 60 env "${row_env[@]}" "$mlacp" "$@" 2>&1); rc=$?
  row_env=()
  if [ "$rc" -ne 2 ] || ! grep -q "^mlacp\|mlacp:" <<<"$out" || ! grep -qF -- "$expected" <<<"$out" \
     || grep -q "Exception raised from\|frame #\|\[c10d\]\|InitGoogleLogging" <<<"$out" || grep -qE "[0-9]{20}" <<<"$out"; then
    echo "FAIL (exit $rc): mlacp $*"; echo "$out" | tail -5 | sed 's/^/    /'
    failures=$((failures + 1))
  fi
}
row "unknown command 'frobnicate'" frobnicate
row "--dp" verify --nproc 2 --dp 0
row "--tp" verify --nproc 2 --tp 0
row "--dp" train --nproc 2 --dp 0 --steps 1
row "--json: must name a file that can be written" verify --single-device --case tiny-causal --json "$work/missing/x.json"
row "it is a folder" verify --single-device --case tiny-causal --json "$work"
row "--json: must name a file that can be written" verify --nproc 2 --json "$work/a_file/x.json"
row "--json: must name a file that can be written" bench --nproc 2 --steps 1 --json "$work/missing/b.json"
row "--json: must name a file that can be written" bench-kernel --json "$work/missing/k.json"
row "--plot: must name a file that can be written" train --nproc 2 --steps 1 --seq 64 --plot "$work/missing/loss.png"
row "--plot: must name a file that can be written" train --compare --steps 1 --seq 64 --plot "$work/missing/loss.png"
row "ulysses" verify --nproc 4 --cp 4 --ulysses 3
row "--frozen prefix must match" verify --nproc 2 --frozen nope
row "exclusive" verify --nproc 2 --case latent-tp2-cp2-gate --seq 64
row "--bandwidth-gbps: must be a finite number >= 0" bench --nproc 2 --bandwidth-gbps -1
row "--bandwidth-gbps: must be a finite number >= 0" bench --nproc 2 --bandwidth-gbps nan
row "--bandwidth-gbps: must be a finite number >= 0" bench --nproc 2 --bandwidth-gbps inf
row "--latency-us: must be a finite number >= 0" bench --nproc 2 --latency-us -5
row "--band" verify --nproc 2 --band -1
row "--masked-rows must be query rows" verify --nproc 2 --band 4 --masked-rows -1
row "--seq" verify --nproc 2 --seq ''
row "--causal" verify --nproc 2 --causal 2
row "--batch" bench --nproc 2 --batch -1
row "the --reference log holds no step" train --nproc 2 --steps 1 --reference "$work/empty.jsonl"
row "--config: must name a readable file; got path=/dev/zero, reason=it is not a regular file" verify --nproc 2 --config /dev/zero
row "--threads" --threads 100000 info --skip-gemm
row "--layers" train --nproc 2 --layers 100000000 --steps 1
# Ranges (tools/option_checks.h): the bound stated readably, 0 excluded where it is.
row "--timeout: must be an integer in [1, 3600]; got value=0" bench --nproc 2 --timeout 0
row "--timeout: must be an integer in [1, 3600]; got value=-1" bench --nproc 2 --timeout -1
row "--timeout: must be an integer in [1, 3600]" train --nproc 2 --steps 1 --timeout 0
row "--dv: must be a finite number > 0; got value=0" bench-kernel --dv 0
row "--lr: must be a finite number > 0" train --nproc 2 --steps 1 --lr 0
row "--bandwidth-gbps: must be a finite number in [0, 1e+06]; got value=nan" plan --bandwidth-gbps nan
# Path arguments: checked while the command line is parsed, before any rank starts.
row "--log: must name a file that can be written; got path=$work/missing/t.jsonl, reason=the folder" \
    train --nproc 2 --steps 1 --seq 64 --log "$work/missing/t.jsonl"
row "--log: must name a file that can be written; got path=$work/a_file/t.jsonl" train --nproc 2 --steps 1 --log "$work/a_file/t.jsonl"
row "--log: must name a file that can be written; got path=$work, reason=it is a folder" train --nproc 2 --steps 1 --log "$work"
row "--out: must name a folder that can be written or created" train --compare --steps 1 --out "$work/a_file/out"
row "--checkpoint: must name a folder that can be written or created; got path=$work/a_file, reason=it exists and is not a folder" \
    train --nproc 2 --steps 1 --checkpoint "$work/a_file"
row "--trace: must name a folder that can be written or created" bench --nproc 2 --steps 1 --trace "$work/a_file/t"
row "--save-hardware: must name a file that can be written" plan --save-hardware "$work/missing/hw.json"
row "--corpus: must name a readable file or folder; got path=$work/missing, reason=it does not exist" \
    train --nproc 2 --steps 1 --corpus "$work/missing"
row "--reference: must name a readable file" train --nproc 2 --steps 1 --reference "$work"
row "--hf-checkpoint: must name a readable folder" train --nproc 2 --steps 1 --hf-checkpoint "$work/a_file"
# Rules of verify's ad-hoc case, before any rank starts.
row "--doc-ends are the documents' ends: each greater than the one before (the first > 0)" \
    verify --nproc 2 --seq 32 --doc-ends 0,16,32
row "empty_document_end=8" verify --nproc 2 --seq 32 --doc-ends 8,8,32
row "the last --doc-ends value must be the sequence length" verify --nproc 2 --seq 32 --doc-ends 8,16
row "at least one input or parameter must require a gradient" verify --nproc 2 --gate \
    --frozen q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_gate_proj,o_proj,hidden
# Checkpoint requests that cannot fit (a damaged checkpoint is exit 4: the fuzz harness's cases).
mkdir "$work/no_generation"
row "--resume needs a checkpoint: a generation folder (step-N/)" train --nproc 2 --steps 1 --checkpoint "$work/no_generation" --resume
row "--resume-fallback says which generation --resume may take: it goes with --resume" \
    train --nproc 2 --steps 1 --checkpoint "$work/no_generation" --resume-fallback
# Torchrun-style variables: a MASTER_ADDR that names no host, before c10d's store retries it.
row_env=(RANK=1 WORLD_SIZE=2 MASTER_ADDR=no-such-host.invalid MASTER_PORT=29400)
row "MASTER_ADDR must be a host name or address that resolves on this host" train --preset test --steps 1 --seq 32
# --device / --backend (docs/DESIGN.md §16): this machine has no GPU, and NCCL moves CUDA tensors only.
row "--device cuda needs a visible CUDA GPU" verify --nproc 2 --device cuda
row "--device cuda needs a visible CUDA GPU" train --nproc 2 --steps 1 --seq 64 --device cuda
row "--device cuda needs a visible CUDA GPU" bench --nproc 2 --steps 1 --device cuda --backend gloo
row "NCCL moves CUDA tensors only" train --nproc 2 --steps 1 --seq 64 --backend nccl
row "NCCL moves CUDA tensors only" verify --nproc 2 --backend nccl
row "--single-device checks the CPU reference against itself" verify --single-device --device cuda
row "--device" verify --nproc 2 --device tpu
row "--backend" bench --nproc 2 --backend mpi
# Runs whose memory estimate exceeds the host (or --memory-limit): rejected before any allocation.
row "the run's memory estimate exceeds the limit" verify --nproc 1 --seq 16384
row "the run's memory estimate exceeds the limit" verify --nproc 2 --heads 100000000
# (--seq 131072: over the limit even with --kv-recompute and --recompute, which the launcher would choose)
row "the run's memory estimate exceeds the limit" train --nproc 2 --layers 1024 --seq 131072 --steps 1
row "the run's memory estimate exceeds the limit" bench --nproc 2 --seq 1000000
row "the run's memory estimate exceeds the limit" bench-kernel --seq 4000000 --heads 64
row "limit=1.00 MiB (--memory-limit 0.0009765625)" --memory-limit 0.0009765625 bench --nproc 2 --steps 1
row "--memory-limit: must be a number of GiB > 0" --memory-limit -3 info --skip-gemm
row "--memory-limit: must be a number of GiB > 0" --memory-limit lots info --skip-gemm
left=$(find "$work" -mindepth 1 ! -name a_file ! -name empty.jsonl ! -name no_generation | wc -l)
[ "$left" -eq 0 ] || { echo "FAIL: files left behind:"; find "$work" -mindepth 1; failures=$((failures + 1)); }
# A valid --json is written (single device: it used to fail for every path).
if ! (cd "$work" && "$mlacp" verify --single-device --case tiny-causal --json "$work/ok.json" >/dev/null 2>&1) \
   || ! grep -q '"passed": true' "$work/ok.json"; then
  echo "FAIL: verify --single-device --json did not write its results"; failures=$((failures + 1))
fi
[ "$failures" -eq 0 ] && echo PASS || { echo "$failures invocation(s) failed"; exit 1; }
