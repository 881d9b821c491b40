// Differentiable collectives for the plain (non-overlapped) schedule: each launches and waits in
// forward, and its backward launches and waits the adjoint collective. Groups of size 1 are the
// identity and add no autograd node.
//   seq_to_head      <-> head_to_seq          (Ulysses, docs/DESIGN.md §4)
//   all_gather_seq    -> reduce_scatter_seq   (latent / K,V gather)
//   all_reduce_sum    -> identity             (row-parallel o_proj over TP)
//   copy_to_tp        -> all_reduce_sum       (entry of the TP region)
// The byte counters see each transfer under transfer_name(t) and its adjoint under
// transfer_name(gradient_of(t)).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/autograd_node.h"
#include "mlacp/comm.h"
#include "mlacp/runtime.h"

namespace mlacp {

std::vector<at::Tensor> seq_to_head(const CommGroup& group, const std::vector<at::Tensor>& xs, Transfer transfer);
at::Tensor head_to_seq(const CommGroup& group, const at::Tensor& x, Transfer transfer);
at::Tensor all_gather_seq(const CommGroup& group, const at::Tensor& x, Transfer transfer);
// TP: label "o_proj" / "hidden" (adjoint "dhidden").
at::Tensor all_reduce_sum(const CommGroup& group, const at::Tensor& x, const std::string& label);
at::Tensor copy_to_tp(const CommGroup& group, const at::Tensor& x);

}  // namespace mlacp
