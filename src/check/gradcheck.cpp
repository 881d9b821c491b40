#include "check/gradcheck.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace mlacp {

std::vector<GradcheckResult> finite_difference_check(const std::function<at::Tensor()>& loss,
                                                     const std::vector<std::pair<std::string, at::Tensor>>& targets,
                                                     const GradcheckOptions& options) {
  std::vector<at::Tensor> leaves;
  for (const auto& target : targets) leaves.push_back(target.second);
  std::vector<at::Tensor> analytic = torch::autograd::grad({loss()}, leaves, /*grad_outputs=*/{},
                                                           /*retain_graph=*/false, /*create_graph=*/false,
                                                           /*allow_unused=*/true);
  // device: finite differences of the CPU float64 oracle
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<GradcheckResult> results;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) {
    at::Tensor x = targets[i].second;
    at::Tensor g = analytic[i].defined() ? analytic[i] : at::zeros_like(x);
    GradcheckResult result{targets[i].first, 0.0, 0};
    auto probe = [&](const at::Tensor& direction) {
      const double eps = options.epsilon;
      x.add_(direction, eps);
      const double plus = loss().item<double>();
      x.add_(direction, -2.0 * eps);
      const double minus = loss().item<double>();
      x.add_(direction, eps);
      const double numeric = (plus - minus) / (2.0 * eps);
      const double exact = (g.to(at::kDouble) * direction.to(at::kDouble)).sum().item<double>();
      result.max_error = std::max(result.max_error, std::abs(numeric - exact) / std::max(1.0, std::abs(exact)));
      ++result.probes;
    };
    for (int d = 0; d < options.directions; ++d) {
      probe(at::normal(0.0, 1.0, x.sizes(), generator, x.options()));
    }
    for (int e = 0; e < options.elements && x.numel() > 0; ++e) {
      const int64_t index = at::randint(x.numel(), {1}, generator, at::kLong).item<int64_t>();
      at::Tensor one_hot = at::zeros({x.numel()}, x.options());
      one_hot[index] = 1.0;
      probe(one_hot.view(x.sizes()));
    }
    results.push_back(result);
  }
  return results;
}

}  // namespace mlacp
