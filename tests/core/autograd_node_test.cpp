// Custom autograd nodes (core/autograd_node.h): the tensors a node's backward captured are freed
// as soon as that backward has run, as LibTorch frees its own nodes' saved variables, not when the
// whole graph dies at the end of the backward pass (a schedule's saved K/V, Q and output would
// otherwise all stay alive through every later node's backward and raise the step's peak); a
// second backward through a freed node is a clear error; retain_graph keeps them; a backward that
// asks for a graph of its own (create_graph) is refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/autograd_node.h"
#include "support/error_of.h"

namespace mlacp {
namespace {

// y = 2·x through a node whose backward captured `held`.
at::Tensor doubled_holding(const at::Tensor& x, const at::Tensor& held) {
  BackwardFn backward = [held](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    EXPECT_TRUE(held.defined());
    return {2.0 * g[0]};
  };
  return attach_backward({x}, {2.0 * x.detach()}, "DoubledHolding", std::move(backward))[0];
}

// y = x through a node that records, when its backward runs, how many references `watched` has.
at::Tensor identity_watching(const at::Tensor& x, const at::Tensor& watched, int64_t* use_count) {
  at::Tensor probe = watched;
  BackwardFn backward = [probe, use_count](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    *use_count = static_cast<int64_t>(probe.use_count());
    return {g[0]};
  };
  return attach_backward({x}, {x.detach().clone()}, "IdentityWatching", std::move(backward))[0];
}

TEST(AutogradNode, CapturedTensorsAreFreedRightAfterTheNodesBackward) {
  const at::Tensor held = at::ones({1024});
  const at::Tensor x = at::ones({4}).requires_grad_(true);
  int64_t use_count_during_backward = -1;
  // Forward: x -> watching -> doubled; backward runs doubled's node first, then watching's.
  at::Tensor y = doubled_holding(identity_watching(x, held, &use_count_during_backward), held);
  EXPECT_EQ(held.use_count(), 3);  // here, the watching node's probe, the doubled node's capture
  y.sum().backward();
  // When the watching node ran, the doubled node had already released its capture: only `held`
  // itself and the watching node's own probe referred to the tensor.
  EXPECT_EQ(use_count_during_backward, 2);
  EXPECT_TRUE(at::equal(x.grad(), at::full({4}, 2.0)));
}

TEST(AutogradNode, ASecondBackwardThroughAFreedNodeIsAClearError) {
  const at::Tensor x = at::ones({4}).requires_grad_(true);
  at::Tensor loss = doubled_holding(x, at::ones({8})).sum();
  loss.backward();
  const std::string message = test::error_of([&] { loss.backward(); });
  EXPECT_NE(message.find("a second time"), std::string::npos) << message;
  EXPECT_NE(message.find("DoubledHolding"), std::string::npos) << message;
  EXPECT_NE(message.find("run the forward again"), std::string::npos) << message;
}

TEST(AutogradNode, RetainGraphKeepsTheCapturedTensorsForASecondBackward) {
  const at::Tensor x = at::ones({4}).requires_grad_(true);
  at::Tensor loss = doubled_holding(x, at::ones({8})).sum();
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  EXPECT_TRUE(at::equal(x.grad(), at::full({4}, 4.0)));
}

// A node's backward makes no graph, so a second derivative through it would be zero: a backward
// under create_graph=True is refused, naming the node.
TEST(AutogradNode, ABackwardWithCreateGraphIsAClearError) {
  const at::Tensor x = at::ones({4}).requires_grad_(true);
  at::Tensor loss = doubled_holding(x, at::ones({8})).sum();
  const std::string message = test::error_of([&] {
    torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  });
  EXPECT_NE(message.find("create_graph=True"), std::string::npos) << message;
  EXPECT_NE(message.find("DoubledHolding"), std::string::npos) << message;
}

}  // namespace
}  // namespace mlacp
