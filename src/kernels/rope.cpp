#include "kernels/rope.h"

#include <cmath>

#include <ATen/ATen.h>

#include "core/device.h"

namespace mlacp {
namespace {

// DeepSeek YaRN: the rope dim at which `rotations` full turns fit in the original context.
double correction_dim(double rotations, int64_t dim, double base, int64_t max_positions) {
  return (dim * std::log(max_positions / (rotations * 2.0 * M_PI))) / (2.0 * std::log(base));
}

}  // namespace

RopeFrequencies make_rope_frequencies(const RopeSettings& settings) {
  const int64_t dim = settings.dim;
  const double base = settings.theta;
  auto f64 = at::TensorOptions().dtype(at::kDouble);
  // [Dr/2]: base^(-2i/Dr)
  at::Tensor exponent = at::arange(0, dim, 2, f64) / static_cast<double>(dim);
  at::Tensor freq_extra = 1.0 / at::pow(base, exponent);
  RopeFrequencies rope;
  rope.lanes = settings.lanes;
  rope.inv_freq = freq_extra;
  if (settings.yarn) {
    const RopeYarnSettings& y = *settings.yarn;
    at::Tensor freq_inter = freq_extra / y.factor;
    double low = std::floor(correction_dim(y.beta_fast, dim, base, y.original_max_position_embeddings));
    double high = std::ceil(correction_dim(y.beta_slow, dim, base, y.original_max_position_embeddings));
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // avoid a zero-width ramp
    at::Tensor ramp = ((at::arange(dim / 2, f64) - low) / (high - low)).clamp(0.0, 1.0);
    at::Tensor extrapolate = 1.0 - ramp;  // 1: keep the original frequency
    rope.inv_freq = freq_inter * (1.0 - extrapolate) + freq_extra * extrapolate;
    rope.magnitude = y.magnitude;
  }
  return rope;
}

RopeTable make_rope_table(const at::Tensor& positions, const RopeFrequencies& rope) {
  // [B, S, Dr/2] angles in float64.
  // inv_freq is host data: it reaches the positions' device without a host synchronisation.
  at::Tensor angles = positions.to(at::kDouble).unsqueeze(-1) * host_to_device(rope.inv_freq, positions.device());
  return {angles.cos() * rope.magnitude, angles.sin() * rope.magnitude, rope.lanes};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTable& table) {
  const int64_t half = x.size(-1) / 2;
  // Broadcast [B|1, S, Dr/2] over x's middle dims.
  std::vector<int64_t> view_shape(x.dim(), 1);
  view_shape[0] = table.cos.size(0);
  view_shape[1] = table.cos.size(1);
  view_shape.back() = half;
  at::Tensor cos = table.cos.to(x.scalar_type()).view(view_shape);
  at::Tensor sin = table.sin.to(x.scalar_type()).view(view_shape);
  at::Tensor lanes = x;
  if (table.lanes == RopeLanes::interleaved) {
    // [..., Dr] -> [..., Dr/2, 2] -> [..., 2, Dr/2] -> [..., Dr]: evens first, then odds.
    std::vector<int64_t> pairs(x.sizes().begin(), x.sizes().end());
    pairs.back() = half;
    pairs.push_back(2);
    lanes = x.reshape(pairs).transpose(-1, -2).reshape(x.sizes());
  }
  at::Tensor x1 = lanes.narrow(-1, 0, half);
  at::Tensor x2 = lanes.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const RopeFrequencies& rope) {
  return apply_rope(x, make_rope_table(positions, rope));
}

}  // namespace mlacp
