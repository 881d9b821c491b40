#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "kernels/rope.h"

namespace mlacp {
namespace {

// Dr 8; with YaRN: factor 4 over 16 original positions, betas 32/1, a cos/sin multiplier != 1.
RopeSettings test_settings(RopeLanes lanes, bool yarn) {
  RopeSettings s;
  s.dim = 8;
  s.lanes = lanes;
  if (yarn) s.yarn = RopeYarnSettings{4.0, 16, 32.0, 1.0, 0.93};
  return s;
}

double rotated_dot(const RopeFrequencies& rope, const at::Tensor& q, const at::Tensor& k, int64_t pq, int64_t pk) {
  auto pos = [](int64_t p) { return at::full({1, 1}, p, at::kLong); };
  return (apply_rope(q, pos(pq), rope) * apply_rope(k, pos(pk), rope)).sum().item<double>();
}

class RopeLayouts : public ::testing::TestWithParam<std::tuple<RopeLanes, bool>> {};

TEST_P(RopeLayouts, ScoresDependOnlyOnPositionDifference) {
  auto [lanes, yarn] = GetParam();
  const RopeFrequencies rope = make_rope_frequencies(test_settings(lanes, yarn));
  at::manual_seed(3);
  at::Tensor q = at::randn({1, 1, 8}, at::kDouble), k = at::randn({1, 1, 8}, at::kDouble);
  for (int64_t delta : {0, 1, 5, 37}) {
    const double base = rotated_dot(rope, q, k, 10 + delta, 10);
    for (int64_t shift : {-10, 3, 1000, 150000}) {
      EXPECT_NEAR(rotated_dot(rope, q, k, 10 + delta + shift, 10 + shift), base, 1e-10)
          << "delta=" << delta << " shift=" << shift;
    }
  }
  // And the score does change with the difference (the test can fail).
  EXPECT_GT(std::abs(rotated_dot(rope, q, k, 11, 10) - rotated_dot(rope, q, k, 14, 10)), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, RopeLayouts,
                         ::testing::Combine(::testing::Values(RopeLanes::half_split, RopeLanes::interleaved),
                                            ::testing::Bool()));

TEST(Rope, PositionZeroIsIdentityUpToLaneOrder) {
  at::Tensor x = at::arange(8, at::kDouble).view({1, 1, 8});
  at::Tensor zero = at::zeros({1, 1}, at::kLong);
  at::Tensor half = apply_rope(x, zero, make_rope_frequencies(test_settings(RopeLanes::half_split, false)));
  EXPECT_TRUE(at::equal(half, x));
  at::Tensor inter = apply_rope(x, zero, make_rope_frequencies(test_settings(RopeLanes::interleaved, false)));
  at::Tensor expected = at::tensor({0., 2., 4., 6., 1., 3., 5., 7.}, at::kDouble).view({1, 1, 8});
  EXPECT_TRUE(at::equal(inter, expected));
}

TEST(Rope, YarnKeepsHighFrequenciesAndScalesLowOnes) {
  // DeepSeek-V3's rope (Dr 64, base 1e4, factor 40, original 4096, beta 32/1): correction range [10, 23].
  RopeSettings s{64, 10000.0, RopeLanes::interleaved, RopeYarnSettings{40.0, 4096, 32.0, 1.0, 1.0}};
  const RopeFrequencies yarn = make_rope_frequencies(s);
  s.yarn.reset();
  const RopeFrequencies plain = make_rope_frequencies(s);
  EXPECT_DOUBLE_EQ(yarn.inv_freq[0].item<double>(), plain.inv_freq[0].item<double>());
  EXPECT_DOUBLE_EQ(yarn.inv_freq[10].item<double>(), plain.inv_freq[10].item<double>());
  EXPECT_NEAR(yarn.inv_freq[31].item<double>(), plain.inv_freq[31].item<double>() / 40.0, 1e-18);
  EXPECT_GT(yarn.inv_freq[15].item<double>(), plain.inv_freq[15].item<double>() / 40.0);
  EXPECT_LT(yarn.inv_freq[15].item<double>(), plain.inv_freq[15].item<double>());
  EXPECT_DOUBLE_EQ(yarn.magnitude, 1.0);
}

TEST(Rope, RotationPreservesNormTimesMagnitude) {
  const RopeFrequencies rope = make_rope_frequencies(test_settings(RopeLanes::half_split, true));
  at::Tensor x = at::randn({2, 5, 3, 8}, at::kDouble);
  at::Tensor pos = at::arange(5, at::kLong).unsqueeze(0).expand({2, 5});
  at::Tensor y = apply_rope(x, pos, rope);
  EXPECT_TRUE(at::allclose(y.norm(2, -1), x.norm(2, -1) * rope.magnitude, 1e-12, 1e-12));
  EXPECT_NE(rope.magnitude, 1.0);
}

}  // namespace
}  // namespace mlacp
