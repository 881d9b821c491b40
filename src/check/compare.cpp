#include "check/compare.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "core/format.h"
#include "mlacp/errors.h"

namespace mlacp {

double max_abs_error(const at::Tensor& a, const at::Tensor& b) {
  MLACP_REQUIRE(a.sizes() == b.sizes(), "compare", "tensors must have the same shape",
          {got("a", shape_text(a)), got("b", shape_text(b))}, "compare matching quantities");
  if (a.numel() == 0) return 0.0;
  return (a.detach().to(at::kDouble) - b.detach().to(at::kDouble).to(a.device())).abs().max().item<double>();
}

double max_rel_error(const at::Tensor& a, const at::Tensor& reference, double floor) {
  if (a.numel() == 0) return 0.0;
  const double scale = std::max(reference.detach().to(at::kDouble).abs().max().item<double>(), floor);
  return max_abs_error(a, reference) / scale;
}

double norm_rel_error(const at::Tensor& a, const at::Tensor& reference, double floor) {
  if (a.numel() == 0) return 0.0;
  const at::Tensor ref = reference.detach().to(at::kDouble);
  const double diff = (a.detach().to(at::kDouble).to(ref.device()) - ref).norm().item<double>();
  return diff / std::max(ref.norm().item<double>(), floor);
}

}  // namespace mlacp
