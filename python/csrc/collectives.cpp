#include "collectives.h"

#include <ATen/ATen.h>

#include "mlacp/errors.h"

namespace mlacp::python {

void all_reduce_sum_(const at::Tensor& tensor, const ProcessGroupPtr& group) {
  MLACP_REQUIRE(tensor.is_contiguous(), "all_reduce_sum_", "the tensor is summed in place and must be contiguous",
                {got("strides", tensor.strides().vec())}, "pass a contiguous tensor");
  std::vector<at::Tensor> sent{tensor.detach()};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  group->allreduce(sent, options)->wait();
}

std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const ProcessGroupPtr& group) {
  const at::Tensor input = tensor.detach().contiguous();
  std::vector<at::Tensor> gathered, received;
  for (int64_t r = 0; r < group->getSize(); ++r) {
    gathered.push_back(at::empty_like(input, at::MemoryFormat::Contiguous));
    received.push_back(gathered.back().detach());
  }
  std::vector<std::vector<at::Tensor>> outputs{received};
  std::vector<at::Tensor> inputs{input.detach()};
  received.clear();
  group->allgather(outputs, inputs)->wait();
  return gathered;
}

}  // namespace mlacp::python
