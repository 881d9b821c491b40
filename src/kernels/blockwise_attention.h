// Blockwise (flash-style) attention on the CPU: the same contract as reference_attention
// (kernels/reference_attention.h) without ever materialising the Sq × Sk scores.
//
//   forward   per (batch, head, query block): loop over key blocks, online softmax,
//             out [B,H,Sq,Dv] and log-sum-exp lse [B,H,Sq] (saved for backward)
//   backward  per (batch, head[, query-block group]): recompute P = exp(S·scale − lse) per
//             block, flash-attention-2 formulas with D = rowsum(dO ∘ O) − dlse
//
// Blocks that causality or documents mask entirely are skipped (decided from each block's
// min/max global token index and document id), so causal costs about half of non-causal.
// Rows with no allowed key give exactly zero output, zero gradient and lse = −inf.
//
// Threads: tiles run on ATen's intra-op pool (at::get_num_threads() workers, dynamic task
// queue; serial when called inside another parallel region). Calls are independent and may run
// concurrently (give each its own BlockwiseStats). A process forked after the pool was used
// runs the kernel serially (libgomp's pool does not survive fork).
//
// Owns: the blockwise math, its CPU micro-kernels and its work scheduling. Does not own: which
// rows a rank holds (callers pass AttentionStructure), autocast policy beyond "bf16 in → bf16
// matmuls", or combining partial results across ranks (lse is returned for that).
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "kernels/reference_attention.h"

namespace mlacp {

// Which compiled code path runs. `automatic` picks the fastest the CPU supports:
//   float64                      -> float64_portable
//   float32                      -> float32_avx512 (AVX-512F), else float32_avx2 (AVX2 + FMA),
//                                   else float32_portable
//   bf16 inputs / bf16 autocast  -> bf16_amx (the GEMMs on AMX tiles: bf16 products, float32
//                                   sums) where the tiles outrun the CPU's float32 FMAs, else
//                                   bf16_avx512 (AVX-512-BF16 dot products: bf16 products,
//                                   float32 sums) where that instruction outruns the CPU's float32
//                                   FMAs, else bf16_via_f32_avx512 (the bf16 values on float32
//                                   FMAs: exact products, float32 sums, P and dS kept in float32),
//                                   else bf16_via_f32_avx2 (the same on AVX2 + FMA), else
//                                   float32_portable on the bf16 values
enum class BlockwisePath {
  automatic,
  float64_portable,
  float32_portable,
  float32_avx512,
  bf16_avx512,
  bf16_via_f32_avx512,
  bf16_amx,
  float32_avx2,
  bf16_via_f32_avx2
};
std::string path_name(BlockwisePath path);

// The bf16 path `automatic` takes on this CPU and the measurement behind it (once per process).
struct Bf16PathChoice {
  BlockwisePath path = BlockwisePath::float32_portable;
  double dot_gflops = 0;  // AVX-512-BF16 micro-kernel, one thread (0: no AVX-512-BF16)
  double fma_gflops = 0;  // float32 AVX-512 micro-kernel, one thread (0: not measured)
  double amx_gflops = 0;  // AMX-BF16 GEMM of a 64 x 64 x 128 block, one thread (0: no AMX)
  std::string reason;     // one line for bench-kernel and info
};
Bf16PathChoice bf16_path_choice();

// Counters of one call, filled when BlockwiseOptions::stats is set. A "block" is one
// (batch, head, query block, key block) tile.
struct BlockwiseStats {
  BlockwisePath path = BlockwisePath::automatic;  // the path that ran
  int64_t block_q = 0;
  int64_t block_k = 0;
  int64_t blocks_total = 0;             // B·H·ceil(Sq/block_q)·ceil(Sk/block_k)
  int64_t forward_blocks_computed = 0;  // tiles the forward multiplied (the rest were skipped)
  int64_t forward_blocks_masked = 0;    // of those, tiles that needed a per-element mask
  int64_t backward_blocks_computed = 0; // tiles the last backward multiplied
};

struct BlockwiseOptions {
  // Rows per query block and per key block; 0 = default (kDefaultBlockQ/K in the .cpp: 128,
  // temporaries per worker ~1 MB). Small blocks (e.g. 5, 7) exercise edges in tests.
  int64_t block_q = 0;
  int64_t block_k = 0;
  // Force a path (tests compare paths); a path the CPU cannot run is an error.
  BlockwisePath path = BlockwisePath::automatic;
  // Optional out-parameter. The autograd node keeps the pointer and updates
  // backward_blocks_computed when backward runs: it must outlive the backward pass.
  BlockwiseStats* stats = nullptr;
};

// q [B,H,Sq,Dqk], k [B,H,Sk,Dqk], v [B,H,Sk,Dv] -> [B,H,Sq,Dv] in q's dtype, differentiable
// w.r.t. q, k, v. float64, float32 or bfloat16 inputs (all three the same); float32 inputs
// under CPU bf16 autocast are computed with bf16 matmuls. The last dim must be dense in memory
// for no copy to happen; any batch/head/row strides are read in place (e.g. a [B,S,H,D]
// tensor transposed to [B,H,S,D]), and outputs/gradients take the layout of q / k / v.
at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               const AttentionStructure& structure, const BlockwiseOptions& options = {});

// The output together with its log-sum-exp, lse[b,h,i] = log Σ_j exp(scaling·q_i·k_j) over
// allowed j (−inf for a row with no allowed key), [B,H,Sq], float32 (float64 for float64
// inputs). Both are differentiable: a gradient on lse enters backward as D_i −= dlse_i.
struct BlockwiseResult {
  at::Tensor out;
  at::Tensor lse;
};
BlockwiseResult blockwise_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             double scaling, const AttentionStructure& structure,
                                             const BlockwiseOptions& options = {});

// The two halves without autograd, for schedules that build their own autograd nodes.
// backward: dout like out; dlse [B,H,Sq] or undefined (zero). Returns {dq, dk, dv}.
BlockwiseResult blockwise_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scaling, const AttentionStructure& structure,
                                            const BlockwiseOptions& options = {});
struct BlockwiseGrads {
  at::Tensor dq, dk, dv;
};
BlockwiseGrads blockwise_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                            const at::Tensor& dlse, double scaling,
                                            const AttentionStructure& structure, const BlockwiseOptions& options = {});

// Row-segment use: a schedule computes the query rows it already holds while the others are in
// flight (kernels/segmented_attention.h builds one autograd node over the segments).
// Forward of q's rows written into `out` ([B,H,Sq,Dv], q's dtype, last dim dense, other strides
// free: e.g. a row range of a larger output); returns lse [B,H,Sq]. No autograd.
at::Tensor blockwise_attention_forward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           double scaling, const AttentionStructure& structure, const at::Tensor& out,
                                           const BlockwiseOptions& options = {});
// Backward of those rows: dq written into into.dq (q-shaped); dK, dV written into into.dk,
// into.dv (k/v-shaped), or added to what they hold when `accumulate_kv` (row segments over the
// same keys sum without an extra pass). Same target rules as above.
void blockwise_attention_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                       const at::Tensor& dlse, double scaling, const AttentionStructure& structure,
                                       const BlockwiseGrads& into, bool accumulate_kv,
                                       const BlockwiseOptions& options = {});
// True when this CPU can run `path` (automatic: always).
bool path_supported(BlockwisePath path);
// The path `automatic` takes on this CPU for inputs of `dtype` (kBFloat16: also float32 inputs
// under CPU bf16 autocast); `mlacp info` prints it.
BlockwisePath automatic_path(c10::ScalarType dtype);

}  // namespace mlacp
