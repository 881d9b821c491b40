#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "check/gradcheck.h"

namespace mlacp {
namespace {

TEST(Gradcheck, AcceptsACorrectGradient) {
  at::Tensor x = at::randn({3, 4}, at::kDouble).requires_grad_(true);
  auto loss = [&] { return (x.sin() * x).sum(); };
  auto results = finite_difference_check(loss, {{"x", x}});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_LT(results[0].max_error, 1e-8);
  EXPECT_EQ(results[0].probes, 6);
}

TEST(Gradcheck, DetectsAWrongGradient) {
  at::Tensor x = at::randn({3, 4}, at::kDouble).requires_grad_(true);
  // Autograd sees x * const, so its gradient is x, but the loss is x²: the true gradient is 2x.
  auto loss = [&] { return (x * x.detach()).sum(); };
  auto results = finite_difference_check(loss, {{"x", x}});
  EXPECT_GT(results[0].max_error, 1e-2);
}

TEST(Gradcheck, RestoresTheTargets) {
  at::Tensor x = at::randn({5}, at::kDouble).requires_grad_(true);
  at::Tensor before = x.detach().clone();
  finite_difference_check([&] { return x.exp().sum(); }, {{"x", x}});
  EXPECT_LT((x.detach() - before).abs().max().item<double>(), 1e-15);
}

}  // namespace
}  // namespace mlacp
