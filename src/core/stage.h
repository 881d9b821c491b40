// Stage: one step of a forward whose backward a schedule runs itself, at the point of its
// choosing. The step is computed on detached copies of its activation inputs with its own
// autograd graph; backprop() later returns the gradients of those activations and of the
// parameters the step read, computed by LibTorch's own backward functions (so they equal, to the
// bit, what the autograd engine would have produced for the same step).
//
// A schedule's backward is then one function that reads in execution order:
//   launch dQ | stage_a.backprop(...) | wait dK | stage_b.backprop(...) | ...
// instead of an order implied by which tensor carries which wait.
//
// Saved tensors are LibTorch's own (version-checked): modifying a parameter or an input in place
// between the forward and backprop() raises LibTorch's in-place error.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mlacp {

class Stage {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& activations)>;
  Stage() = default;
  // Runs fn on detached copies of `activations` (requiring grad like the originals, or as
  // `needs_grad` says for activations computed without grad; sharing their version counters).
  // `parameters` are the parameters fn reads (used as they are, not copied).
  Stage(std::string name, std::vector<at::Tensor> activations, std::vector<at::Tensor> parameters, const Fn& fn,
        const std::vector<bool>& needs_grad = {});

  const std::vector<at::Tensor>& outputs() const;
  const at::Tensor& output(size_t i) const { return outputs().at(i); }
  // Whether backprop() has anything to compute (some output depends on something that needs grad).
  bool requires_grad() const { return requires_grad_; }
  // The tensors a schedule node takes as inputs for this stage: activations, then parameters.
  std::vector<at::Tensor> inputs() const;
  // One gradient per output (undefined = zero) -> one per inputs() entry (undefined where not
  // needed). Once; frees the stage's graph.
  std::vector<at::Tensor> backprop(const std::vector<at::Tensor>& output_grads);
  // Drops the stage's references to its outputs once the schedule has consumed them (sent them,
  // computed from them): backprop() needs only the graph, whose edges the stage kept when it was
  // built. Without this an overlapped schedule would keep, e.g., its local Q until the backward,
  // beside the exchanged Q the attention saved. output() is an error afterwards.
  void release_outputs();

 private:
  struct Graph;  // the autograd edges backprop() runs between (stage.cpp)
  std::string name_;
  std::vector<at::Tensor> activations_;  // the originals (their autograd identity is the node's edge)
  std::vector<at::Tensor> parameters_;
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<Graph> graph_;
  bool requires_grad_ = false;
  bool released_ = false;
  bool done_ = false;
};

// Appends b to a (inputs and gradients of several stages handed to one node).
inline void append(std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) { a.insert(a.end(), b.begin(), b.end()); }

}  // namespace mlacp
