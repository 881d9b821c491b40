// Attention through pieces and a varlen kernel: the path CUDA tensors take (docs/DESIGN.md §16),
// the same contract as reference_attention (kernels/reference_attention.h).
//
//   no mask   plan_pieces (kernels/attention_pieces.h) -> one varlen call per piece group (causal
//             bottom-right, full) over rows gathered from q, k, v -> rows scattered back, a row in
//             several pieces combined by log-sum-exp. Backward: each group's kernel backward with
//             the final output and log-sum-exp of its rows (the flash-attention identity, so the
//             pieces' gradients add up exactly), dQ/dK/dV accumulated in float32 (float64).
//   mask      the dense masked form: an additive bias (0 allowed, a large negative value not
//             allowed) of [B|1, 1, Sq, Sk], broadcast over heads. A row with no allowed key gets an
//             all-zero bias row (an ordinary row for the kernel: no row is masked entirely, which
//             the fused kernels' backward turned into NaN on a GPU) and its output and incoming
//             gradient are replaced by zeros (zero output, zero gradient). The mask is S×S already;
//             the bias is the only S×S tensor this path makes.
//
// Kernels (VarlenKernel, docs/DESIGN.md §16), by device and dtype (varlen_kernel_for):
//   CUDA bf16/fp16      LibTorch's flash attention with V zero-padded to Dqk (varlen through
//                       cu_seqlens, bottom-right causal), the faster on an H200 (§16);
//                       MLACP_CUDA_ATTENTION=efficient takes the memory-efficient kernel instead
//   CUDA float32        LibTorch's memory-efficient attention (the CUTLASS kernel of
//                       scaled_dot_product_attention: Dqk ≠ Dv, varlen through cu_seqlens,
//                       bottom-right causal, an additive bias); masks take it in every dtype
//   CUDA float64, CPU   a reference kernel with plain ATen math per piece (the fused kernels have no
//                       float64; the CPU tests run the planning and the combination through it)
// Which kernel ran is in PieceStats.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "kernels/attention_pieces.h"

namespace mlacp {

// Packed rows of one group: q [T_q, H, Dqk], k [T_k, H, Dqk], v [T_k, H, Dv], pieces by the group's
// cu_query / cu_key (host), scores scaled by `scaling`.
struct VarlenCall {
  at::Tensor q, k, v;
  const PieceGroup* group = nullptr;
  double scaling = 1;
};
// Dense masked call: q [B, Sq, H, Dqk], k [B, Sk, H, Dqk], v [B, Sk, H, Dv], bias [B|1, 1, Sq, Sk]
// in q's dtype (broadcast over heads).
struct DenseCall {
  at::Tensor q, k, v, bias;
  double scaling = 1;
};
// out like q's rows with Dv; lse [T_q, H] (varlen) or [B, Sq, H] (dense), float32 (float64 for
// float64 inputs).
// state: what the kernel's backward needs from its forward besides the final out and lse (e.g.
// the random-number state flash attention returns); handed back to backward() as it was.
struct PieceResult {
  at::Tensor out, lse;
  std::vector<at::Tensor> state;
};
struct PieceGrads {
  at::Tensor dq, dk, dv;
};

class VarlenKernel {
 public:
  virtual ~VarlenKernel() = default;
  virtual std::string name() const = 0;
  virtual PieceResult forward(const VarlenCall& call) const = 0;
  // out, lse: the final values of the call's rows (not necessarily what forward returned for them);
  // state: forward's PieceResult::state.
  virtual PieceGrads backward(const VarlenCall& call, const at::Tensor& out, const at::Tensor& lse,
                              const at::Tensor& dout, const std::vector<at::Tensor>& state) const = 0;
  virtual PieceResult dense_forward(const DenseCall& call) const = 0;
  virtual PieceGrads dense_backward(const DenseCall& call, const at::Tensor& out, const at::Tensor& lse,
                                    const at::Tensor& dout, const std::vector<at::Tensor>& state) const = 0;
};

// Plain ATen math per piece (scores of one piece at a time), any device and dtype (float32 math
// for 16-bit inputs). The oracle of the piece path's planning and combination.
const VarlenKernel& reference_varlen_kernel();
// LibTorch's memory-efficient CUDA attention; nullptr when this LibTorch lacks it (1.13).
const VarlenKernel* memory_efficient_varlen_kernel();
// LibTorch's flash attention with V padded to Dqk (16-bit); nullptr where this LibTorch lacks it.
const VarlenKernel* flash_padded_varlen_kernel();
// MLACP_CUDA_ATTENTION: "auto" (unset), "efficient" or "flash"; anything else is an error naming them.
std::string cuda_attention_setting();
// The kernel for tensors of `dtype` on `device` (the table above; an error where a CUDA kernel is
// unavailable).
const VarlenKernel& varlen_kernel_for(const c10::Device& device, at::ScalarType dtype);

struct PieceStats {
  std::string kernel;                 // the VarlenKernel's name
  bool masked = false;                // the dense masked path ran
  int64_t groups = 0, pieces = 0;     // varlen calls and pieces of the last forward
  bool each_row_once = true;
};

// q [B,H,Sq,Dqk], k [B,H,Sk,Dqk], v [B,H,Sk,Dv] -> [B,H,Sq,Dv] in q's dtype ([B,Sq,H,Dv] memory),
// differentiable w.r.t. q, k, v. Under CUDA autocast float32 inputs run in the autocast dtype.
// kernel: nullptr = varlen_kernel_for(q's device).
at::Tensor piece_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                           const AttentionStructure& structure, const VarlenKernel* kernel = nullptr,
                           PieceStats* stats = nullptr);

}  // namespace mlacp
