// See torch_sdpa.h.
#include "kernels/torch_sdpa.h"

#include <ATen/ATen.h>

#include "core/compat.h"

namespace mlacp {
namespace {

at::Tensor value_operand(const at::Tensor& k, const at::Tensor& v, const TorchSdpaCall& call) {
  const int64_t pad = k.size(-1) - v.size(-1);
  if (!call.pad_value || pad <= 0) return v;
  return at::constant_pad_nd(v, {0, pad});
}

}  // namespace

bool torch_sdpa_available() { return MLACP_TORCH_2 != 0; }

#if MLACP_TORCH_2
std::string torch_sdpa_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               bool causal, const TorchSdpaCall& call) {
  at::NoGradGuard no_grad;
  // at::SDPBackend's values (ATen/SDPBackend.h), stable since 2.0
  switch (at::_fused_sdp_choice(q, k, value_operand(k, v, call), {}, 0.0, causal, scaling)) {
    case 0: return "math";
    case 1: return "flash_attention";
    case 2: return "efficient_attention";
    case 3: return "cudnn_attention";
    case 4: return "overrideable";
    default: return "error";
  }
}

at::Tensor torch_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling, bool causal,
                      const TorchSdpaCall& call) {
  at::Tensor out = at::scaled_dot_product_attention(q, k, value_operand(k, v, call), {}, 0.0, causal, scaling);
  return out.size(-1) == v.size(-1) ? out : out.narrow(-1, 0, v.size(-1));
}
#else
std::string torch_sdpa_backend(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
                               const TorchSdpaCall&) {
  return "unavailable";
}

at::Tensor torch_sdpa(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool, const TorchSdpaCall&) {
  TORCH_CHECK(false, "torch_sdpa: LibTorch 1.x has no scaled_dot_product_attention (2.x has)");
}
#endif

}  // namespace mlacp
