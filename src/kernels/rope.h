// Rotary position embedding for MLA (docs/DESIGN.md §1 step 5): the frequencies (plain or DeepSeek YaRN)
// and their application in half-split or interleaved lane order.
// Owns: the math. Does not own: where positions come from (forward inputs / the plan).
#pragma once

#include <ATen/core/Tensor.h>

#include "mlacp/config.h"

namespace mlacp {

struct RopeFrequencies {
  at::Tensor inv_freq;     // [Dr/2] float64, CPU
  double magnitude = 1.0;  // YaRN cos/sin multiplier
  RopeLayout layout = RopeLayout::half_split;
};

RopeFrequencies make_rope_frequencies(const MlaConfig& config);

// x: [B, S, ..., Dr] (any number of middle dims, e.g. heads); positions: [B, S] int64.
// Returns the rotated x in x's dtype. Interleaved layout de-interleaves lanes first (DeepSeek
// rope_interleave), so its output lanes are in half-split order, for q and k alike.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const RopeFrequencies& rope);

}  // namespace mlacp
