#include "runtime/collective_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace mlacp {
namespace {

using torch::autograd::variable_list;

class LambdaBackward : public torch::autograd::Node {
 public:
  using Fn = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)>;
  LambdaBackward(std::string name, Fn fn, std::vector<at::Tensor> output_templates)
      : name_(std::move(name)), fn_(std::move(fn)), templates_(std::move(output_templates)) {}
  variable_list apply(variable_list&& grads) override {
    for (size_t i = 0; i < grads.size(); ++i)
      if (!grads[i].defined()) grads[i] = at::zeros_like(templates_[i]);
    return fn_(std::move(grads));
  }
  std::string name() const override { return name_; }
  void release_variables() override { templates_.clear(); }

 private:
  std::string name_;
  Fn fn_;
  std::vector<at::Tensor> templates_;  // empty tensors with each output's shape and options
};

}  // namespace

std::vector<at::Tensor> attach_backward(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                                        const std::string& name, LambdaBackward::Fn backward) {
  for (auto& out : outputs) out = out.detach();  // fresh autograd identity (not a view of a buffer)
  bool any = false;
  for (const auto& in : inputs) any = any || (in.defined() && in.requires_grad());
  if (!any || !at::GradMode::is_enabled()) return outputs;
  std::vector<at::Tensor> templates;
  for (const auto& out : outputs) templates.push_back(at::empty(out.sizes(), out.options()));
  auto node = std::shared_ptr<LambdaBackward>(new LambdaBackward(name, std::move(backward), std::move(templates)),
                                              torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(outputs, node);
  return outputs;
}

std::vector<at::Tensor> seq_to_head(const CommGroup& group, const std::vector<at::Tensor>& xs,
                                    const std::string& label) {
  if (group.size() == 1) return xs;
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_seq_to_head_packed(group, xs, label).wait();
  }
  return attach_backward(xs, std::move(outputs), "SeqToHeadBackward[" + label + "]",
                         [group, label](std::vector<at::Tensor> grads) {
                           return launch_head_to_seq_packed(group, grads, "d" + label).wait();
                         });
}

at::Tensor head_to_seq(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  if (group.size() == 1) return x;
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_head_to_seq(group, x, label).wait();
  }
  return attach_backward({x}, std::move(outputs), "HeadToSeqBackward[" + label + "]",
                         [group, label](std::vector<at::Tensor> grads) {
                           return launch_seq_to_head(group, grads[0], "d" + label).wait();
                         })[0];
}

at::Tensor all_gather_seq(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  if (group.size() == 1) return x;
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_all_gather_seq(group, x, label).wait();
  }
  return attach_backward({x}, std::move(outputs), "AllGatherSeqBackward[" + label + "]",
                         [group, label](std::vector<at::Tensor> grads) {
                           return launch_reduce_scatter_seq(group, grads[0], "d" + label).wait();
                         })[0];
}

at::Tensor all_reduce_sum(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  if (group.size() == 1) return x;
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_all_reduce_sum(group, x, label).wait();
  }
  return attach_backward({x}, std::move(outputs), "AllReduceSumBackward[" + label + "]",
                         [](std::vector<at::Tensor> grads) { return grads; })[0];
}

at::Tensor copy_to_tp(const CommGroup& group, const at::Tensor& x, const std::string& label) {
  if (group.size() == 1) return x;
  return attach_backward({x}, {x}, "CopyToTpBackward[" + label + "]", [group, label](std::vector<at::Tensor> grads) {
    return launch_all_reduce_sum(group, grads[0], "d" + label).wait();
  })[0];
}

}  // namespace mlacp
