// torch's own attention as a yardstick (`mlacp bench-kernel --vs-torch`): LibTorch's
// scaled_dot_product_attention on the same q, k, v as mlacp's kernel. SDPA's fused CPU kernel
// (flash) needs equal head dims, so for MLA's Dqk=192, Dv=128 V is zero-padded to Dqk and the
// output sliced back (as DeepSpeed-Ulysses users do); unpadded it falls back to its math kernel.
// LibTorch 1.13 has no SDPA: torch_sdpa_available() is false there.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace mlacp {

bool torch_sdpa_available();

// q [B,H,Sq,Dqk], k [B,H,Sk,Dqk], v [B,H,Sk,Dv]; causal: the upper-left triangle (Sq == Sk).
struct TorchSdpaCall {
  bool pad_value = true;  // pad V to Dqk where Dv != Dqk
};

// The backend SDPA dispatches these operands to: "flash_attention", "math", "efficient_attention",
// "cudnn_attention", "overrideable", or "unavailable" (LibTorch 1.13).
std::string torch_sdpa_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               bool causal, const TorchSdpaCall& call = {});

// The attention output [B,H,Sq,Dv], differentiable in q, k, v (the padding is part of the graph).
// Throws on LibTorch 1.13.
at::Tensor torch_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling, bool causal,
                      const TorchSdpaCall& call = {});

}  // namespace mlacp
