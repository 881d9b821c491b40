// The model's side of RoPE: MlaConfig -> the kernels' plain RopeSettings.
// Owns: which config fields the rope kernel sees. Does not own: the rope math (kernels/rope.h).
#pragma once

#include "kernels/rope.h"
#include "mlacp/config.h"

namespace mlacp {

// Dr, rope_theta, rope_layout and the YaRN parameters, with the YaRN cos/sin multiplier
// precomputed as config.rope_magnitude_scale().
RopeSettings rope_settings(const MlaConfig& config);

}  // namespace mlacp
