// The one place that chooses the local attention kernel: blockwise on the CPU by default, varlen pieces
// on other devices (CUDA) or when asked, the reference oracle for checking.
#pragma once

#include "kernels/reference_attention.h"
#include "mlacp/plan.h"

namespace mlacp {

// q [B,H,Sq,Dqk], k [B,H,Sk,Dqk], v [B,H,Sk,Dv] -> [B,H,Sq,Dv]; the same contract for both kernels.
at::Tensor attend(AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  double scaling, const AttentionStructure& structure);

}  // namespace mlacp
