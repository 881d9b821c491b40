// Stage (core/stage.h): backprop() returns what torch::autograd::grad returns for the same step,
// to the bit, also after the stage has released its outputs (the overlapped schedules drop their
// local Q/K/V that way once sent), for views as outputs and unused inputs too; releasing frees the
// outputs; reading them afterwards, or changing them in place before the backward, is an error.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/stage.h"
#include "support/error_of.h"

namespace mlacp {
namespace {

// The step: two outputs from one activation and one parameter.
std::vector<at::Tensor> step(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = at::tanh(x.mm(w));
  return {y * 3.0, (y.narrow(1, 0, 2) + x.narrow(1, 0, 2)).sum(1)};
}

struct Fixture {
  at::Tensor x = at::randn({5, 4}, at::kDouble).requires_grad_(true);
  at::Tensor w = at::randn({4, 6}, at::kDouble).requires_grad_(true);
  at::Tensor g0 = at::randn({5, 6}, at::kDouble), g1 = at::randn({5}, at::kDouble);
  // torch::autograd::grad over the same ops: the expected gradients of x and w.
  std::vector<at::Tensor> expected(bool second_grad) {
    const at::Tensor xl = x.detach().requires_grad_(true), wl = w.detach().requires_grad_(true);
    std::vector<at::Tensor> out = step(xl, wl);
    return torch::autograd::grad(out, {xl, wl}, {g0, second_grad ? g1 : at::zeros_like(g1)});
  }
  std::unique_ptr<Stage> stage() {
    return std::make_unique<Stage>("test", std::vector<at::Tensor>{x}, std::vector<at::Tensor>{w},
                                   [this](const std::vector<at::Tensor>& a) { return step(a[0], w); });
  }
};

TEST(Stage, BackpropEqualsAutogradGradToTheBit) {
  at::manual_seed(1);
  Fixture f;
  const std::vector<at::Tensor> expected = f.expected(true);
  std::vector<at::Tensor> got = f.stage()->backprop({f.g0, f.g1});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(at::equal(got[0], expected[0]));
  EXPECT_TRUE(at::equal(got[1], expected[1]));
  // An undefined output gradient counts as zero.
  const std::vector<at::Tensor> zero_second = f.expected(false);
  got = f.stage()->backprop({f.g0, at::Tensor()});
  EXPECT_TRUE(at::equal(got[0], zero_second[0]));
  EXPECT_TRUE(at::equal(got[1], zero_second[1]));
}

TEST(Stage, ReleasedOutputsAreFreedAndBackpropStillEqualsAutogradGrad) {
  at::manual_seed(2);
  Fixture f;
  const std::vector<at::Tensor> expected = f.expected(true);
  std::unique_ptr<Stage> stage = f.stage();
  const c10::weak_intrusive_ptr<c10::TensorImpl> first(stage->output(0).getIntrusivePtr());
  EXPECT_FALSE(first.expired());
  stage->release_outputs();
  EXPECT_TRUE(first.expired()) << "the stage's graph or the stage still holds its output";
  const std::string message = test::error_of([&] { (void)stage->output(0); });
  EXPECT_NE(message.find("after release_outputs()"), std::string::npos) << message;
  const std::vector<at::Tensor> got = stage->backprop({f.g0, f.g1});
  EXPECT_TRUE(at::equal(got[0], expected[0]));
  EXPECT_TRUE(at::equal(got[1], expected[1]));
}

TEST(Stage, AViewOutputAndAnUnusedActivationMatchAutogradGrad) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({5, 4}, at::kDouble).requires_grad_(true);
  const at::Tensor unused = at::randn({3}, at::kDouble).requires_grad_(true);
  const at::Tensor w = at::randn({4, 6}, at::kDouble).requires_grad_(true);
  const at::Tensor g = at::randn({5, 2}, at::kDouble);
  auto fn = [&w](const std::vector<at::Tensor>& a) { return std::vector<at::Tensor>{at::sin(a[0].mm(w)).narrow(1, 1, 2)}; };
  const at::Tensor xl = x.detach().requires_grad_(true), wl = w.detach().requires_grad_(true);
  const std::vector<at::Tensor> expected =
      torch::autograd::grad({at::sin(xl.mm(wl)).narrow(1, 1, 2)}, {xl, wl}, {g});
  Stage stage("view", {x, unused}, {w}, fn);
  stage.release_outputs();
  const std::vector<at::Tensor> got = stage.backprop({g});
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(at::equal(got[0], expected[0]));
  EXPECT_FALSE(got[1].defined());  // nothing reached it
  EXPECT_TRUE(at::equal(got[2], expected[1]));
}

TEST(Stage, AnOutputModifiedInPlaceBeforeTheBackwardIsAnError) {
  at::manual_seed(4);
  Fixture f;
  std::unique_ptr<Stage> stage = f.stage();
  stage->output(0).mul_(2.0);
  const std::string message = test::error_of([&] { stage->backprop({f.g0, f.g1}); });
  EXPECT_NE(message.find("modified in place"), std::string::npos) << message;
}

TEST(Stage, NothingToComputeWhenNoInputRequiresGrad) {
  const at::Tensor x = at::randn({5, 4}, at::kDouble), w = at::randn({4, 6}, at::kDouble);
  Stage stage("frozen", {x}, {w}, [&w](const std::vector<at::Tensor>& a) { return step(a[0], w); });
  EXPECT_FALSE(stage.requires_grad());
  const std::vector<at::Tensor> got = stage.backprop({at::ones({5, 6}, at::kDouble), at::Tensor()});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_FALSE(got[0].defined());
  EXPECT_FALSE(got[1].defined());
}

}  // namespace
}  // namespace mlacp
