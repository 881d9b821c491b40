// Error measures used by every correctness check (all computed in float64).
#pragma once

#include <ATen/core/Tensor.h>

namespace mlacp {

// max |a - b|; 0 for two empty tensors. Shapes must match.
double max_abs_error(const at::Tensor& a, const at::Tensor& b);
// max |a - b| / max(max |b|, floor): error relative to the reference's scale.
double max_rel_error(const at::Tensor& a, const at::Tensor& reference, double floor = 1e-30);

// ||a - b||_2 / ||reference||_2: the error of a whole tensor, robust to a few tiny entries
// (used for bf16, where per-element relative errors are meaningless near zero).
double norm_rel_error(const at::Tensor& a, const at::Tensor& reference, double floor = 1e-30);

}  // namespace mlacp
