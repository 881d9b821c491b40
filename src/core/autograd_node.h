// Custom autograd nodes from plain functions: the building block of mlacp's differentiable
// collectives, schedules and kernels (a C++ Node may hold any state, unlike saved_data).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace mlacp {

using BackwardFn = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)>;

// Tensors a backward function reads, with their version counters at forward time: check()
// rejects an in-place change made in between (naming the tensor), as LibTorch's own saved
// variables do. Store them as plain aliases (detached): no autograd identity, no reference cycle.
// Undefined entries are allowed (optional tensors) and never checked.
class SavedForBackward {
 public:
  SavedForBackward(std::vector<at::Tensor> tensors, std::vector<std::string> names);
  void check(const char* what) const;  // throws mlacp::Error
  const at::Tensor& operator[](size_t i) const { return tensors_[i]; }

 private:
  std::vector<at::Tensor> tensors_;
  std::vector<std::string> names_;
  std::vector<int64_t> versions_;
};

// Attaches `outputs` (fresh tensors computed without grad) to an autograd node whose backward is
// `backward`: it receives one gradient per output (undefined ones arrive as zeros) and returns
// one gradient per input (undefined for inputs that need none). Returns the outputs, now
// differentiable w.r.t. `inputs`; unchanged when no input requires grad or grad mode is off.
std::vector<at::Tensor> attach_backward(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                                        const std::string& name, BackwardFn backward);

}  // namespace mlacp
