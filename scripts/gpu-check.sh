#!/usr/bin/env bash
# The GPU check of the CUDA path (issue 14, docs/DESIGN.md §16). One command on a GPU machine,
# results under the folder it names (default gpu-check-<UTC time>/; summary.txt is the digest):
#   scripts/gpu-check.sh [OUT_DIR]
#   1. build mlacp and mlacp_gpu_check against the machine's PyTorch (python3's torch, a CUDA
#      build; MLACP_GPU_PYTHON picks another), for the GPU's own architecture;
#   2. exactness on one GPU: every attention structure through the varlen pieces with each CUDA
#      kernel (memory-efficient float32 and bf16, flash bf16) and the MLA layer's single-device
#      cases, float32 and bf16 autocast, against the float64 CPU reference; no host synchronisation
#      in an attention step or a layer step (CUDA's sync debug mode at "error");
#   3. attention TFLOP/s forward and forward+backward at S = 8K..64K, each kernel, next to the
#      GPU's bf16 GEMM rate;
#   4. the MLA layer forward+backward at DeepSeek-V3 dims (128 heads), tokens/s; tokens/s of
#      `mlacp train --device cuda` on one GPU (bf16 autocast);
#   5. multi-rank: with >= 4 GPUs, `mlacp verify --case all` (the exactness matrix, P = 4) over
#      NCCL; with 2-3 GPUs, the default matrix on 2 ranks over NCCL; with one GPU, the exactness
#      matrix on 4 ranks sharing it over Gloo's CUDA path (NCCL refuses two ranks on one GPU):
#      the CUDA runtime (pieces, streams, device events) with host-staged transfers, said as such
#      in summary.txt; then `mlacp bench --device cuda` on 2 ranks (the timeline on CUDA events).
# The machine may have no network: a machine without nlohmann-json's and CLI11's CMake packages
# and gloo's headers (a PyTorch wheel ships none) gets them from .gpu-deps/*.deb, fetched
# beforehand where apt works with
#   scripts/gpu-check.sh --prepare
# (header-only packages, unpacked into .gpu-deps/root, never into /; carry .gpu-deps along). MLACP_GPU_CHECK_QUICK=1
# skips steps 4b and 5 (a shorter run). MLACP_GPU_PREBUILT=DIR takes DIR/mlacp and DIR/mlacp_gpu_check,
# built elsewhere against the same PyTorch version (e.g. from the wheel of the GPU machine's version,
# to spend the GPU machine's time on the checks), when they start there; else it builds. Each step
# runs under a time limit (MLACP_GPU_STEP_LIMIT seconds, default 240), so a hung step is reported,
# not waited for. Exit code: 0 all passed, 1 a check failed, 2 the machine or the build is unfit.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$root/.gpu-deps"
if [[ "${1:-}" == --prepare ]]; then
  mkdir -p "$deps"
  (cd "$deps" && apt-get download nlohmann-json3-dev libcli11-dev libgloo-dev) || exit 2
  ls -la "$deps"
  exit 0
fi
out="${1:-$root/gpu-check-$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
t0=$SECONDS
log() { echo "gpu-check: $*" | tee -a "$out/summary.txt"; }
status=0

if ! nvidia-smi >"$out/nvidia-smi.txt" 2>&1; then
  log "nvidia-smi failed: not a GPU machine (see nvidia-smi.txt)"
  exit 2
fi
gpus="$(nvidia-smi -L | wc -l)"
log "GPUs: $gpus ($(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1))"
python="${MLACP_GPU_PYTHON:-$(command -v python3)}"
torch_dir="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" || { log "no torch in $python"; exit 2; }
log "torch $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())') at $torch_dir"
prefix="$torch_dir;$torch_dir/share/cmake"
extra_flags=""
if compgen -G "$deps/*.deb" >/dev/null; then
  mkdir -p "$deps/root"
  for f in "$deps"/*.deb; do
    if command -v dpkg >/dev/null; then
      dpkg -x "$f" "$deps/root"
    else  # a .deb is an ar archive holding data.tar.*
      (cd "$deps/root" && ar p "$f" "$(ar t "$f" | grep '^data.tar')" | tar -x -f - --auto-compress 2>/dev/null ||
       ar p "$f" "$(ar t "$f" | grep '^data.tar')" | tar -x -J -f -)
    fi
  done
  prefix="$prefix;$deps/root/usr"
  extra_flags="-isystem $deps/root/usr/include"  # gloo's headers (no CMake package)
fi
arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')"

# The machine's LibTorch and the CUDA libraries of the NVIDIA wheels beside it, for binaries built
# elsewhere (a build here has the same in its run path).
libs="$torch_dir/lib"
for d in "$torch_dir"/../nvidia/*/lib "$torch_dir"/../nvidia/cu*/lib; do [[ -d "$d" ]] && libs="$libs:$(cd "$d" && pwd)"; done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
limit="${MLACP_GPU_STEP_LIMIT:-240}"
prebuilt="${MLACP_GPU_PREBUILT:-}"
if [[ -n "$prebuilt" ]] && "$prebuilt/mlacp" info --skip-gemm >"$out/info.txt" 2>&1 && [[ -x "$prebuilt/mlacp_gpu_check" ]]; then
  build="$(cd "$prebuilt" && pwd)"
  log "1. prebuilt binaries from $prebuilt (they start with this machine's LibTorch): $(grep -m1 '^LibTorch' "$out/info.txt")"
else
  [[ -n "$prebuilt" ]] && log "1. the prebuilt binaries in $prebuilt do not start here (info.txt): building"
  # 1. build (Ninja when there: faster on many cores)
  build="${MLACP_GPU_BUILD_DIR:-$root/build-gpu}"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  if ! TORCH_CUDA_ARCH_LIST="$arch" cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DMLACP_BUILD_TESTS=OFF -DMLACP_BUILD_GPU_CHECK=ON -DCMAKE_PREFIX_PATH="$prefix" \
        -DCMAKE_CXX_FLAGS="$extra_flags" >"$out/configure.log" 2>&1; then
    log "1. configure FAILED (configure.log)"
    tail -20 "$out/configure.log"
    exit 2
  fi
  if ! cmake --build "$build" -j "$(nproc)" --target mlacp mlacp_gpu_check >"$out/build.log" 2>&1; then
    log "1. build FAILED (build.log)"
    grep -m 20 -B2 -A6 "error" "$out/build.log" || tail -40 "$out/build.log"
    exit 2
  fi
  log "1. build for sm $arch: $((SECONDS - t0)) s"
  "$build/mlacp" info --skip-gemm >"$out/info.txt" 2>&1 || true
fi
mlacp="$build/mlacp"

# 2-4. one GPU
t1=$SECONDS
timeout "$limit" "$build/mlacp_gpu_check" "$out" >"$out/gpu_check.log" 2>&1 || status=1
log "2-4. exactness, host synchronisation, rates: $((SECONDS - t1)) s, $(grep -c PASS "$out/gpu_check.tsv" || true) passed, $(grep -c FAIL "$out/gpu_check.tsv" || true) failed (gpu_check.tsv)"
grep -E "^rate" "$out/gpu_check.tsv" | grep -E "GEMM|share|tokens" | tee -a "$out/summary.txt"
grep -E "FAIL" "$out/gpu_check.tsv" | head -20 | tee -a "$out/summary.txt"

if [[ "${MLACP_GPU_CHECK_QUICK:-0}" != 1 ]]; then
  # 4b. the training job on one GPU: the small preset, and a decoder with DeepSeek-V3's attention
  # dims (16 heads, hidden 2048, 4 layers; byte vocabulary) at S = 4096
  cat >"$out/train-v3dims.json" <<'JSON'
{"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 1536,
 "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
 "num_hidden_layers": 4, "intermediate_size": 5632, "vocab_size": 256, "rms_norm_eps": 1e-6,
 "rope_theta": 10000.0}
JSON
  for model in small v3dims; do
    t1=$SECONDS
    model_args=(--preset small)
    [[ $model == v3dims ]] && model_args=(--config "$out/train-v3dims.json")
    if timeout "$limit" "$mlacp" train --device cuda --nproc 1 --dtype bfloat16 --steps 30 --seq 4096 --timeout 300 "${model_args[@]}" \
          --log "$out/train-$model.jsonl" >"$out/train-$model.log" 2>&1; then
      log "4b. mlacp train --device cuda --nproc 1 --dtype bfloat16 --seq 4096 ($model): $(grep -E 'tokens/s' "$out/train-$model.log" | tail -1) ($((SECONDS - t1)) s)"
    else
      status=1
      log "4b. mlacp train --device cuda ($model) FAILED (train-$model.log): $(grep -m1 'mlacp:' "$out/train-$model.log")"
    fi
  done

  # 5. multi-rank
  t1=$SECONDS
  if ((gpus >= 4)); then
    form="4 ranks over NCCL, one GPU each: the exactness matrix"
    verify=(verify --device cuda --backend nccl --nproc 4 --case all)
  elif ((gpus >= 2)); then
    form="2 ranks over NCCL, one GPU each: the default matrix"
    verify=(verify --device cuda --backend nccl --nproc 2)
  else
    form="4 ranks on the one GPU over Gloo's CUDA path (host-staged transfers; NCCL refuses two ranks on one GPU): the exactness matrix"
    verify=(verify --device cuda --backend gloo --nproc 4 --case all)
  fi
  if timeout "$limit" "$mlacp" "${verify[@]}" --timeout 300 --json "$out/verify-cuda.json" >"$out/verify.log" 2>&1; then
    log "5. multi-rank, $form: $(grep -E '^verify:' "$out/verify.log" | tail -1) ($((SECONDS - t1)) s)"
  else
    status=1
    log "5. multi-rank, $form: FAILED (verify.log): $(grep -E '^verify:|^FAIL|mlacp:' "$out/verify.log" | head -5 | tr '\n' ' ')"
  fi
  t1=$SECONDS
  backend=nccl
  ((gpus >= 2)) || backend=gloo
  if timeout "$limit" "$mlacp" bench --device cuda --backend "$backend" --nproc 2 --seq 4096 --steps 5 --warmup 2 --dtype bfloat16 \
        --json "$out/bench-cuda.json" >"$out/bench.log" 2>&1; then
    log "5b. mlacp bench --device cuda --backend $backend --nproc 2 --seq 4096 (timeline on CUDA events): ($((SECONDS - t1)) s)"
    grep -E "^\| |strategy" "$out/bench.log" | head -8 | tee -a "$out/summary.txt"
  else
    status=1
    log "5b. mlacp bench --device cuda FAILED (bench.log): $(grep -m1 'mlacp:' "$out/bench.log")"
  fi
fi
log "total $((SECONDS - t0)) s; results in $out; exit $status"
exit "$status"
