// The Python package's own collectives over torch.distributed groups (the gradient and loss sums,
// the agreement table, gathered positions and logits).
//
// The backend is handed detached aliases of the caller's tensors: the same storage, but tensor
// objects no Python object points to. Gloo's worker thread drops its last reference to a finished
// work after the caller has gone on; if that reference were the caller's tensor and its Python
// object had died meanwhile, the worker would take the GIL to free it, and during the interpreter's
// finalization that aborts the process ("terminate called without an active exception", seen at
// the exit of examples/hf_context_parallel.py; pytorch/pytorch#190489). The C++ library's own
// collectives already send detached tensors (src/runtime).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "layer.h"

namespace mlacp::python {

// Sums `tensor` (contiguous) in place over `group`; returns when the sum is in `tensor`.
void all_reduce_sum_(const at::Tensor& tensor, const ProcessGroupPtr& group);

// Every member's `tensor` in group rank order, one new contiguous tensor each.
std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const ProcessGroupPtr& group);

}  // namespace mlacp::python
