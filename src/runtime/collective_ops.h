// Differentiable collectives for the plain (non-overlapped) schedule: each launches and waits in
// forward, and its backward launches and waits the adjoint collective. Groups of size 1 are the
// identity and add no autograd node.
//   seq_to_head      <-> head_to_seq          (Ulysses, SPEC §4)
//   all_gather_seq    -> reduce_scatter_seq   (latent / K,V gather)
//   all_reduce_sum    -> identity             (row-parallel o_proj over TP)
//   copy_to_tp        -> all_reduce_sum       (entry of the TP region)
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/autograd_node.h"
#include "mlacp/comm.h"

namespace mlacp {

std::vector<at::Tensor> seq_to_head(const CommGroup& group, const std::vector<at::Tensor>& xs, const std::string& label);
at::Tensor head_to_seq(const CommGroup& group, const at::Tensor& x, const std::string& label);
at::Tensor all_gather_seq(const CommGroup& group, const at::Tensor& x, const std::string& label);
at::Tensor all_reduce_sum(const CommGroup& group, const at::Tensor& x, const std::string& label);
at::Tensor copy_to_tp(const CommGroup& group, const at::Tensor& x, const std::string& label);

}  // namespace mlacp
