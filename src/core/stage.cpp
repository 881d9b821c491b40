#include "core/stage.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "mlacp/errors.h"

namespace mlacp {

Stage::Stage(std::string name, std::vector<at::Tensor> activations, std::vector<at::Tensor> parameters, const Fn& fn,
             const std::vector<bool>& needs_grad)
    : name_(std::move(name)), activations_(std::move(activations)), parameters_(std::move(parameters)) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (size_t i = 0; i < activations_.size(); ++i) {
    const at::Tensor& a = activations_[i];
    if (!a.defined()) {
      leaves_.push_back(a);
      continue;
    }
    at::Tensor leaf = a.detach();  // shares data and version counter
    const bool needs = i < needs_grad.size() ? needs_grad[i] : a.requires_grad();
    if (grad_mode && needs) leaf.requires_grad_(true);
    leaves_.push_back(leaf);
  }
  outputs_ = fn(leaves_);
  for (const at::Tensor& out : outputs_) requires_grad_ = requires_grad_ || (out.defined() && out.requires_grad());
}

std::vector<at::Tensor> Stage::inputs() const {
  std::vector<at::Tensor> all = activations_;
  append(all, parameters_);
  return all;
}

std::vector<at::Tensor> Stage::backprop(const std::vector<at::Tensor>& output_grads) {
  MLACP_REQUIRE(!done_, "schedule stage", "a stage's backward ran twice", {got("stage", name_)},
                "this is a schedule bug: each stage is backpropagated once per forward");
  done_ = true;
  std::vector<at::Tensor> result(activations_.size() + parameters_.size());
  if (!requires_grad_) return result;
  std::vector<at::Tensor> roots, root_grads, wrt;
  for (size_t i = 0; i < outputs_.size(); ++i) {
    if (!outputs_[i].defined() || !outputs_[i].requires_grad()) continue;
    roots.push_back(outputs_[i]);
    root_grads.push_back(i < output_grads.size() && output_grads[i].defined() ? output_grads[i]
                                                                              : at::zeros_like(outputs_[i]));
  }
  std::vector<size_t> where;
  for (size_t i = 0; i < leaves_.size(); ++i)
    if (leaves_[i].defined() && leaves_[i].requires_grad()) wrt.push_back(leaves_[i]), where.push_back(i);
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (parameters_[i].defined() && parameters_[i].requires_grad())
      wrt.push_back(parameters_[i]), where.push_back(leaves_.size() + i);
  if (roots.empty() || wrt.empty()) return result;
  std::vector<at::Tensor> grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                                        /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t j = 0; j < grads.size(); ++j) result[where[j]] = grads[j];
  outputs_.clear();  // the graph is spent
  leaves_.clear();
  return result;
}

}  // namespace mlacp
