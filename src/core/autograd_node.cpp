#include "core/autograd_node.h"

#include <ATen/ATen.h>
#include <memory>
#include <mutex>
#include <string>

#include "core/compat.h"
#include "mlacp/errors.h"
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace mlacp {
namespace {

using torch::autograd::variable_list;

class LambdaBackward : public torch::autograd::Node {
 public:
  struct OutputMeta {
    std::vector<int64_t> sizes;
    at::TensorOptions options;
  };
  LambdaBackward(std::string name, BackwardFn fn, std::vector<OutputMeta> outputs)
      : name_(std::move(name)), fn_(std::make_shared<BackwardFn>(std::move(fn))), outputs_(std::move(outputs)) {}
  variable_list apply(variable_list&& grads) override {
    std::shared_ptr<BackwardFn> fn;
    {
      // Node's contract: apply and release_variables may race when two backward passes share a
      // graph; the function is taken under the node's mutex and runs outside it.
      std::lock_guard<std::mutex> lock(mutex_);
      fn = fn_;
    }
    MLACP_REQUIRE(fn != nullptr, "autograd", "backward ran through an mlacp node a second time, after its saved "
                  "tensors were freed", {got("node", name_)},
                  "run the forward again before another backward (a CP layer's backward runs once per forward)");
    // The engine runs a node with grad mode on only under create_graph=True: a backward function
    // computes its gradients without a graph, so a second derivative through it would silently be
    // zero. Refused instead.
    MLACP_REQUIRE(!at::GradMode::is_enabled(), "autograd",
                  "a backward through an mlacp node was asked for a graph of its own (create_graph=True): "
                  "mlacp's nodes compute first derivatives only",
                  {got("node", name_)},
                  "differentiate once (backward without create_graph); for second derivatives run the layer "
                  "single-device with the reference kernel outside mlacp");
    for (size_t i = 0; i < grads.size(); ++i)
      if (!grads[i].defined()) grads[i] = at::zeros(outputs_[i].sizes, outputs_[i].options);
    return (*fn)(std::move(grads));
  }
  std::string name() const override { return name_; }
  // Called by the engine once apply() has run without retain_graph: the backward function and the
  // tensors it captured are freed now, as LibTorch's own nodes free their saved variables, rather
  // than when the whole graph dies at the end of backward.
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_.reset();
  }

 private:
  std::string name_;
  std::shared_ptr<BackwardFn> fn_;
  std::vector<OutputMeta> outputs_;  // shape and options of each output
};

}  // namespace

SavedForBackward::SavedForBackward(std::vector<at::Tensor> tensors, std::vector<std::string> names)
    : tensors_(std::move(tensors)), names_(std::move(names)) {
  for (const at::Tensor& t : tensors_) versions_.push_back(t.defined() ? static_cast<int64_t>(t._version()) : -1);
}

void SavedForBackward::check(const char* what) const {
  for (size_t i = 0; i < tensors_.size(); ++i)
    MLACP_REQUIRE(!tensors_[i].defined() || static_cast<int64_t>(tensors_[i]._version()) == versions_[i], what,
                  "a tensor saved for backward was modified in place after the forward",
                  {got("tensor", i < names_.size() ? names_[i] : std::to_string(i)),
                   got("version_at_forward", versions_[i]),
                   got("version_now", static_cast<int64_t>(tensors_[i]._version()))},
                  "modify a clone instead, or run backward before changing it (e.g. optimizer.step() after backward)");
}

std::vector<at::Tensor> attach_backward(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                                        const std::string& name, BackwardFn backward) {
  for (auto& out : outputs) out = out.detach();  // fresh autograd identity (not a view of a buffer)
  bool any = false;
  for (const auto& in : inputs) any = any || (in.defined() && in.requires_grad());
  if (!any || !at::GradMode::is_enabled()) return outputs;
  std::vector<LambdaBackward::OutputMeta> metas;
  for (const auto& out : outputs) metas.push_back({out.sizes().vec(), out.options()});
  auto node = compat::make_node<LambdaBackward>(name, std::move(backward), std::move(metas));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(outputs, node);
  return outputs;
}

}  // namespace mlacp
