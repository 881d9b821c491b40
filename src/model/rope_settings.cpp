#include "model/rope_settings.h"

namespace mlacp {

RopeSettings rope_settings(const MlaConfig& config) {
  RopeSettings settings;
  settings.dim = config.qk_rope_head_dim;
  settings.theta = config.rope_theta;
  settings.lanes = config.rope_layout == RopeLayout::interleaved ? RopeLanes::interleaved : RopeLanes::half_split;
  if (config.yarn) {
    const YarnScaling& y = *config.yarn;
    settings.yarn = RopeYarnSettings{y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow,
                                     config.rope_magnitude_scale()};
  }
  return settings;
}

}  // namespace mlacp
