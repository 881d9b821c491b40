#include "check/single_device_checks.h"

#include "model/mla_layer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "check/compare.h"
#include "check/gradcheck.h"
#include "core/compat.h"

namespace mlacp {
namespace {

double worst(double a, double b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }

at::Tensor loss_of(const at::Tensor& output, const at::Tensor& weight) {
  return (output.to(at::kDouble) * weight.to(at::kDouble)).sum();
}

}  // namespace

ForwardBackward run_forward_backward(MlaAttention& module, const CaseInputs& inputs) {
  at::Tensor hidden = inputs.hidden.detach().clone().requires_grad_(true);
  for (auto& p : module->parameters()) p.mutable_grad() = at::Tensor();
  ForwardBackward result;
  result.output = module->forward(hidden, inputs.options);
  loss_of(result.output, inputs.output_weight).backward();
  result.output = result.output.detach();
  result.gradients.emplace_back("hidden", hidden.grad().to(at::kDouble));
  for (const auto& item : module->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    result.gradients.emplace_back(item.key(), g.defined() ? g.to(at::kDouble) : at::zeros_like(item.value()));
  }
  return result;
}

std::vector<CheckRow> check_gradients_fd(const VerifyCase& c) {
  MlaAttention module = make_case_module(c, at::kDouble);
  CaseInputs inputs = make_case_inputs(c, at::kDouble);
  at::Tensor hidden = inputs.hidden.clone().requires_grad_(true);
  std::vector<std::pair<std::string, at::Tensor>> targets{{"hidden", hidden}};
  for (const auto& item : module->named_parameters()) targets.emplace_back(item.key(), item.value());
  auto loss = [&] { return loss_of(module->forward(hidden, inputs.options), inputs.output_weight); };
  double input_error = 0.0, param_error = 0.0;
  for (const GradcheckResult& r : finite_difference_check(loss, targets)) {
    (r.name == "hidden" ? input_error : param_error) = worst(r.name == "hidden" ? input_error : param_error, r.max_error);
  }
  return {{c.name, "fd grad input (f64)", input_error, kFiniteDifferenceTolerance},
          {c.name, "fd grad params (f64)", param_error, kFiniteDifferenceTolerance}};
}

std::vector<CheckRow> check_float32_agreement(const VerifyCase& c) {
  MlaAttention m64 = make_case_module(c, at::kDouble);
  MlaAttention m32 = make_case_module(c, at::kFloat);
  ForwardBackward r64 = run_forward_backward(m64, make_case_inputs(c, at::kDouble));
  ForwardBackward r32 = run_forward_backward(m32, make_case_inputs(c, at::kFloat));
  double grad_error = 0.0;
  for (size_t i = 0; i < r64.gradients.size(); ++i)
    grad_error = worst(grad_error, max_rel_error(r32.gradients[i].second, r64.gradients[i].second));
  return {{c.name, "f32 vs f64 output (rel)", max_rel_error(r32.output, r64.output), kFloat32RelTolerance},
          {c.name, "f32 vs f64 grads (rel)", grad_error, kFloat32RelTolerance}};
}

std::vector<CheckRow> check_bf16_autocast(const VerifyCase& c) {
  MlaAttention m64 = make_case_module(c, at::kDouble);
  MlaAttention m32 = make_case_module(c, at::kFloat);
  ForwardBackward r64 = run_forward_backward(m64, make_case_inputs(c, at::kDouble));
  ForwardBackward rbf;
  {
    compat::AutocastGuard autocast(c10::DeviceType::CPU, true, at::kBFloat16);
    rbf = run_forward_backward(m32, make_case_inputs(c, at::kFloat));
  }
  double grad_error = 0.0;
  for (size_t i = 0; i < r64.gradients.size(); ++i)
    grad_error = worst(grad_error, norm_rel_error(rbf.gradients[i].second, r64.gradients[i].second));
  return {{c.name, "bf16 autocast output (norm rel)", norm_rel_error(rbf.output, r64.output), kBf16OutputTolerance},
          {c.name, "bf16 autocast grads (norm rel)", grad_error, kBf16GradTolerance}};
}

std::vector<CheckRow> check_packed_equals_separate(const VerifyCase& c) {
  if (c.document_ends.empty()) return {};
  MlaAttention module = make_case_module(c, at::kDouble);
  CaseInputs inputs = make_case_inputs(c, at::kDouble);
  at::NoGradGuard no_grad;
  at::Tensor packed = module->forward(inputs.hidden, inputs.options);  // [1, S, d]
  double error = 0.0;
  int64_t start = 0;
  for (int64_t end : c.document_ends) {
    if (end == 0) continue;
    MlaForwardOptions alone;
    alone.is_causal = c.causal;
    at::Tensor separate = module->forward(inputs.hidden.narrow(1, start, end - start), alone);
    error = worst(error, max_abs_error(packed.narrow(1, start, end - start), separate));
    start = end;
  }
  return {{c.name, "packed == separate docs", error, kExactTolerance}};
}

std::vector<CheckRow> check_masked_rows(const VerifyCase& c) {
  if (c.masked_rows.empty()) return {};
  MlaAttention module = make_case_module(c, at::kDouble);
  CaseInputs inputs = make_case_inputs(c, at::kDouble);
  const ResolvedForward resolved = MlaLayer::resolve(*module, inputs.hidden, inputs.options);
  LocalLatents latents = MlaLayer::compute_latents(*module, inputs.hidden);
  at::Tensor query_latent = latents.query_latent.detach().requires_grad_(true);
  latents.query_latent = query_latent;
  at::Tensor core = MlaLayer::single_device_core(*module, latents, resolved);  // [B, S, H*Dv]
  (core * core).sum().backward();
  double error = 0.0;
  if (!core.isfinite().all().item<bool>() || !query_latent.grad().isfinite().all().item<bool>()) error = NAN;
  for (int64_t row : c.masked_rows) {
    error = worst(error, core.select(1, row).abs().max().item<double>());
    error = worst(error, query_latent.grad().select(1, row).abs().max().item<double>());
  }
  return {{c.name, "masked row: out, grad == 0", error, 0.0}};
}

std::vector<CheckRow> run_single_device_checks(const VerifyCase& c) {
  std::vector<CheckRow> rows;
  for (auto check : {check_gradients_fd, check_float32_agreement, check_bf16_autocast, check_packed_equals_separate,
                     check_masked_rows}) {
    std::vector<CheckRow> more = check(c);
    rows.insert(rows.end(), more.begin(), more.end());
  }
  return rows;
}

}  // namespace mlacp
