// Rotary position embedding for MLA (docs/DESIGN.md §1 step 5): the frequencies (plain or DeepSeek YaRN)
// and their application in half-split or interleaved lane order.
// Owns: the math. Does not own: where positions come from (forward inputs / the plan), nor the
// model config: the model turns its MlaConfig into RopeSettings (model/rope_settings.h).
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace mlacp {

// Lane order of the rope dims. Mirrors the model's RopeLayout (mlacp/config.h), which the
// kernels may not include.
enum class RopeLanes {
  half_split,   // rotate_half on [x1 | x2]
  interleaved,  // de-interleave even/odd lanes, then half-split
};

// DeepSeek YaRN frequency ramp, plus the cos/sin multiplier the model derives from its mscales.
struct RopeYarnSettings {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double magnitude = 1.0;  // multiplier applied to cos/sin
};

// Everything the rope kernel needs to know; plain values, no model types.
struct RopeSettings {
  int64_t dim = 0;         // Dr: rotated lanes per head (even)
  double theta = 10000.0;  // frequency base
  RopeLanes lanes = RopeLanes::half_split;
  std::optional<RopeYarnSettings> yarn;  // none: plain frequencies, magnitude 1
};

struct RopeFrequencies {
  at::Tensor inv_freq;     // [Dr/2] float64, CPU
  double magnitude = 1.0;  // YaRN cos/sin multiplier
  RopeLanes lanes = RopeLanes::half_split;
};

RopeFrequencies make_rope_frequencies(const RopeSettings& settings);

// The rotation of each token: cos and sin of its angles, magnitude applied, [B|1, S, Dr/2].
// Computed once per forward from positions, or given by the caller (HuggingFace's
// position_embeddings: its own rope, whatever its type, at its own precision).
struct RopeTable {
  at::Tensor cos;
  at::Tensor sin;
  RopeLanes lanes = RopeLanes::half_split;
};
// positions [B, S] int64 -> the table in float64.
RopeTable make_rope_table(const at::Tensor& positions, const RopeFrequencies& rope);
// x: [B, S, ..., Dr]; returns the rotated x in x's dtype (the table is cast to it).
at::Tensor apply_rope(const at::Tensor& x, const RopeTable& table);

// x: [B, S, ..., Dr] (any number of middle dims, e.g. heads); positions: [B, S] int64.
// Returns the rotated x in x's dtype. Interleaved layout de-interleaves lanes first (DeepSeek
// rope_interleave), so its output lanes are in half-split order, for q and k alike.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const RopeFrequencies& rope);

}  // namespace mlacp
