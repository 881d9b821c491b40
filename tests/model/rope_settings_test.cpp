// MlaConfig -> RopeSettings: the fields the rope kernel sees (kernels/rope.h takes no model types).
#include <gtest/gtest.h>

#include "mlacp/config.h"
#include "model/rope_settings.h"

namespace mlacp {
namespace {

TEST(RopeSettings, DeepSeekV3CarriesDimThetaLanesAndYarn) {
  const MlaConfig c = preset_config("deepseek-v3");
  const RopeSettings s = rope_settings(c);
  EXPECT_EQ(s.dim, 64);
  EXPECT_EQ(s.theta, c.rope_theta);
  EXPECT_EQ(s.lanes, RopeLanes::interleaved);
  ASSERT_TRUE(s.yarn.has_value());
  EXPECT_EQ(s.yarn->factor, 40.0);
  EXPECT_EQ(s.yarn->original_max_position_embeddings, 4096);
  EXPECT_EQ(s.yarn->beta_fast, 32.0);
  EXPECT_EQ(s.yarn->beta_slow, 1.0);
  EXPECT_EQ(s.yarn->magnitude, 1.0);  // mscale == mscale_all_dim
}

TEST(RopeSettings, MagnitudeIsTheConfigsRopeMagnitudeScale) {
  MlaConfig c = preset_config("tiny");
  c.qk_rope_head_dim = 8;
  c.rope_theta = 50000.0;
  c.yarn = YarnScaling{4.0, 16, 16.0, 2.0, 0.707, 1.0};
  const RopeSettings s = rope_settings(c);
  ASSERT_TRUE(s.yarn.has_value());
  EXPECT_EQ(s.yarn->magnitude, c.rope_magnitude_scale());
  EXPECT_NE(s.yarn->magnitude, 1.0);
  EXPECT_EQ(s.yarn->beta_fast, 16.0);
  EXPECT_EQ(s.yarn->beta_slow, 2.0);
  EXPECT_EQ(s.theta, 50000.0);
  EXPECT_EQ(make_rope_frequencies(s).magnitude, c.rope_magnitude_scale());
}

TEST(RopeSettings, NoYarnIsPlainHalfSplit) {
  MlaConfig c = preset_config("tiny");
  c.rope_layout = RopeLayout::half_split;
  c.yarn.reset();
  const RopeSettings s = rope_settings(c);
  EXPECT_EQ(s.dim, c.qk_rope_head_dim);
  EXPECT_EQ(s.lanes, RopeLanes::half_split);
  EXPECT_FALSE(s.yarn.has_value());
  EXPECT_EQ(make_rope_frequencies(s).magnitude, 1.0);
}

}  // namespace
}  // namespace mlacp
