#include "core/stage.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include "mlacp/errors.h"

namespace mlacp {

struct Stage::Graph {
  torch::autograd::edge_list roots;  // the gradient edges of the outputs that require grad
  std::vector<size_t> root_output;   // which output each root is
  std::vector<std::vector<int64_t>> root_sizes;
  std::vector<at::TensorOptions> root_options;
  // The outputs' version counters (no data) and versions when the edges were taken: an output
  // changed in place afterwards would have a newer grad_fn than the recorded edge.
  std::vector<c10::VariableVersion> root_counters;
  std::vector<uint32_t> root_versions;
  torch::autograd::edge_list wrt;  // leaves, then parameters, that require grad
  std::vector<size_t> wrt_input;   // their index in inputs()
};

Stage::Stage(std::string name, std::vector<at::Tensor> activations, std::vector<at::Tensor> parameters, const Fn& fn,
             const std::vector<bool>& needs_grad)
    : name_(std::move(name)), activations_(std::move(activations)), parameters_(std::move(parameters)) {
  const bool grad_mode = at::GradMode::is_enabled();
  std::vector<at::Tensor> leaves;  // detached copies fn computes with (kept alive by the graph that uses them)
  for (size_t i = 0; i < activations_.size(); ++i) {
    const at::Tensor& a = activations_[i];
    if (!a.defined()) {
      leaves.push_back(a);
      continue;
    }
    at::Tensor leaf = a.detach();  // shares data and version counter
    const bool needs = i < needs_grad.size() ? needs_grad[i] : a.requires_grad();
    if (grad_mode && needs) leaf.requires_grad_(true);
    leaves.push_back(leaf);
  }
  outputs_ = fn(leaves);
  for (const at::Tensor& out : outputs_) requires_grad_ = requires_grad_ || (out.defined() && out.requires_grad());
  if (!requires_grad_) return;
  // What backprop() needs, as torch::autograd::grad would take it from the tensors: the outputs'
  // gradient edges (their grad_fn) and the leaves' and parameters' (their gradient accumulators,
  // where the engine captures the gradients instead of accumulating them).
  graph_ = std::make_shared<Graph>();
  for (size_t i = 0; i < outputs_.size(); ++i) {
    const at::Tensor& out = outputs_[i];
    if (!out.defined() || !out.requires_grad()) continue;
    graph_->roots.push_back(torch::autograd::impl::gradient_edge(out));
    graph_->root_output.push_back(i);
    graph_->root_sizes.push_back(out.sizes().vec());
    graph_->root_options.push_back(out.options());
    graph_->root_counters.push_back(torch::autograd::impl::version_counter(out));
    graph_->root_versions.push_back(graph_->root_counters.back().current_version());
  }
  for (size_t i = 0; i < leaves.size(); ++i)
    if (leaves[i].defined() && leaves[i].requires_grad())
      graph_->wrt.push_back(torch::autograd::impl::gradient_edge(leaves[i])), graph_->wrt_input.push_back(i);
  for (size_t i = 0; i < parameters_.size(); ++i)
    if (parameters_[i].defined() && parameters_[i].requires_grad())
      graph_->wrt.push_back(torch::autograd::impl::gradient_edge(parameters_[i])),
          graph_->wrt_input.push_back(leaves.size() + i);
}

const std::vector<at::Tensor>& Stage::outputs() const {
  MLACP_REQUIRE(!released_, "schedule stage", "a stage's outputs were read after release_outputs()", {got("stage", name_)},
                "this is a schedule bug: release a stage's outputs after their last use in the forward");
  return outputs_;
}

void Stage::release_outputs() {
  released_ = true;
  outputs_.clear();
}

std::vector<at::Tensor> Stage::inputs() const {
  std::vector<at::Tensor> all = activations_;
  append(all, parameters_);
  return all;
}

std::vector<at::Tensor> Stage::backprop(const std::vector<at::Tensor>& output_grads) {
  MLACP_REQUIRE(!done_, "schedule stage", "a stage's backward ran twice", {got("stage", name_)},
                "a CP layer's backward runs once per forward: run the forward again before another backward "
                "(retain_graph=True does not keep a schedule's stages)");
  done_ = true;
  std::vector<at::Tensor> result(activations_.size() + parameters_.size());
  const std::shared_ptr<Graph> graph = std::move(graph_);  // spent after this call
  outputs_.clear();
  if (!graph || graph->roots.empty() || graph->wrt.empty()) return result;
  for (size_t r = 0; r < graph->roots.size(); ++r)
    MLACP_REQUIRE(graph->root_counters[r].current_version() == graph->root_versions[r], "schedule stage",
                  "a stage's output was modified in place between the forward and its backward",
                  {got("stage", name_), got("output", static_cast<int64_t>(graph->root_output[r]))},
                  "this is a schedule bug: modify a clone of a stage's output");
  std::vector<at::Tensor> root_grads;
  for (size_t r = 0; r < graph->roots.size(); ++r) {
    const size_t i = graph->root_output[r];
    root_grads.push_back(i < output_grads.size() && output_grads[i].defined()
                             ? output_grads[i]
                             : at::zeros(graph->root_sizes[r], graph->root_options[r]));
  }
  // torch::autograd::grad(outputs, inputs, grads, retain_graph=false, create_graph=false,
  // allow_unused=true), from the edges: the engine runs the stage's graph and returns the
  // gradients captured at `wrt` (undefined where nothing reached them).
  const std::vector<at::Tensor> grads = torch::autograd::Engine::get_default_engine().execute(
      graph->roots, root_grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false, graph->wrt);
  for (size_t j = 0; j < grads.size(); ++j) result[graph->wrt_input[j]] = grads[j];
  return result;
}

}  // namespace mlacp
