// One MLA attention layer as the Python package runs it: the C++ module over the caller's
// parameter tensors (given anew at every forward: FSDP's gathered parameters, a checkpointed
// recomputation's inputs), its CP install over torch.distributed's groups, and the functional
// forward/backward pair that mlacp's torch.library custom op is made of (python/mlacp/_ops.py).
//
// Functional form ("boxed"): forward() runs the layer with its autograd graph kept aside, keyed by
// a small tensor; backward(key, grad) runs that graph. The graph lives exactly as long as the key
// tensor's storage, so whoever holds the key (autograd's saved tensors, a compiled graph, a
// checkpoint that drops and recomputes it) decides when the layer's saved activations go.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "mlacp/attention.h"
#include "mlacp/comm.h"
#include "mlacp/config.h"
#include "mlacp/plan.h"
#include "mlacp/runtime.h"

namespace mlacp::python {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// What one forward needs besides the hidden states and the parameters.
struct LayerInputs {
  std::vector<at::Tensor> weights;      // in parameter_names() order
  std::vector<bool> needs_grad;         // hidden's, then one per weight
  at::Tensor cos, sin;                  // rotary tables of the local tokens [B|1, S_l, Dr]
  std::optional<std::vector<int64_t>> document_ends;  // global exclusive ends (packed documents)
  bool training = true;
};

class Layer {
 public:
  Layer(const MlaConfig& config, at::ScalarType dtype, const c10::Device& device);

  // Parameter names and shapes in the order forward() takes the weights.
  const std::vector<std::pair<std::string, std::vector<int64_t>>>& parameters() const { return parameters_; }

  std::string parallelize(const ProcessGroupPtr& cp, int64_t ulysses, const ProcessGroupPtr& ulysses_group,
                          const ProcessGroupPtr& all_gather_group, const CpOptions& options);

  // The layer's output and its key (a [1] int64 tensor; 0 when nothing needs a gradient). Called
  // by the custom op below autograd: the graph is built here, aside, with no saved-tensor hooks.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& hidden, const LayerInputs& inputs);

  std::map<std::string, int64_t> comm_bytes() const;
  int64_t expected_comm_bytes(int64_t batch, int64_t seq_len, int64_t wire_bytes) const;
  void reset_comm_counters();
  std::string description() const { return module_->parallel_description(); }
  const MlaConfig& config() const { return module_->config(); }

 private:
  MlaAttention module_{nullptr};
  c10::Device device_;
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameters_;
  ParallelGroups groups_;
  std::optional<CpPlan> plan_;
};

// The gradients of a boxed forward: grad_hidden, then one per weight (undefined where none was
// needed). Consumes the box: a second backward through the same forward is an mlacp::Error.
std::vector<at::Tensor> boxed_backward(const at::Tensor& key, const at::Tensor& grad_output);

// How many boxed forwards hold their graphs now (for tests: freed keys free their graphs).
int64_t live_boxes();

}  // namespace mlacp::python
