// Finite-difference gradient checking in float64 (LibTorch C++ has no gradcheck).
// For each target tensor, autograd's gradient g is compared with central differences of the
// loss along random directions d (all elements at once: <g, d> vs (L(x+εd) - L(x-εd)) / 2ε)
// and along a few single elements. A wrong gradient anywhere shows up in a random direction.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mlacp {

struct GradcheckResult {
  std::string name;
  double max_error = 0.0;  // max |numeric - analytic| / max(1, |analytic|) over the probes
  int64_t probes = 0;
};

struct GradcheckOptions {
  int directions = 2;  // random directions per target
  int elements = 4;    // single elements per target (chosen at random)
  double epsilon = 1e-6;
  uint64_t seed = 1234;
};

// `loss` must build a scalar float64 loss from the current target values, with or without grad
// mode. Targets are leaves that require grad; they are perturbed in place and restored.
std::vector<GradcheckResult> finite_difference_check(const std::function<at::Tensor()>& loss,
                                                     const std::vector<std::pair<std::string, at::Tensor>>& targets,
                                                     const GradcheckOptions& options = {});

}  // namespace mlacp
