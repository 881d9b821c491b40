#include "runtime/collective_ops.h"

#include <ATen/ATen.h>

namespace mlacp {
std::vector<at::Tensor> seq_to_head(const CommGroup& group, const std::vector<at::Tensor>& xs, Transfer transfer) {
  if (group.size() == 1) return xs;
  const std::string label = transfer_name(transfer), adjoint = transfer_name(gradient_of(transfer));
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_seq_to_head_packed(group, xs, label).wait();
  }
  return attach_backward(xs, std::move(outputs), "SeqToHeadBackward[" + label + "]",
                         [group, adjoint](std::vector<at::Tensor> grads) {
                           return launch_head_to_seq_packed(group, grads, adjoint).wait();
                         });
}

at::Tensor head_to_seq(const CommGroup& group, const at::Tensor& x, Transfer transfer) {
  if (group.size() == 1) return x;
  const std::string label = transfer_name(transfer), adjoint = transfer_name(gradient_of(transfer));
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_head_to_seq(group, x, label).wait();
  }
  return attach_backward({x}, std::move(outputs), "HeadToSeqBackward[" + label + "]",
                         [group, adjoint](std::vector<at::Tensor> grads) {
                           return launch_seq_to_head(group, grads[0], adjoint).wait();
                         })[0];
}

at::Tensor all_gather_seq(const CommGroup& group, const at::Tensor& x, Transfer transfer) {
  if (group.size() == 1) return x;
  const std::string label = transfer_name(transfer), adjoint = transfer_name(gradient_of(transfer));
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = launch_all_gather_seq(group, x, label).wait();
  }
  return attach_backward({x}, std::move(outputs), "AllGatherSeqBackward[" + label + "]",
                         [group, adjoint](std::vector<at::Tensor> grads) {
                           return launch_reduce_scatter_seq(group, grads[0], adjoint).wait();
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

at::Tensor copy_to_tp(const CommGroup& group, const at::Tensor& x) {
  if (group.size() == 1) return x;
  return attach_backward({x}, {x}, "CopyToTpBackward[hidden]", [group](std::vector<at::Tensor> grads) {
    return launch_all_reduce_sum(group, grads[0], "dhidden").wait();
  })[0];
}

}  // namespace mlacp
