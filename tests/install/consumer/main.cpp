// Uses the installed mlacp: one MLA layer forward and backward on a single device.
#include <cmath>
#include <iostream>

#include <ATen/ATen.h>

#include "mlacp/attention.h"
#include "mlacp/config.h"

int main() {
  const mlacp::MlaConfig config = mlacp::preset_config("tiny");
  mlacp::MlaAttention layer(config);
  const at::Tensor x = at::randn({1, 16, config.hidden_size}).requires_grad_(true);
  const at::Tensor y = layer->forward(x);
  y.square().sum().backward();
  const bool finite = at::isfinite(y).all().item<bool>() && at::isfinite(x.grad()).all().item<bool>();
  std::cout << "mlacp consumer: output " << y.sizes() << (finite ? " finite: ok" : " NOT finite") << "\n";
  return finite ? 0 : 1;
}
