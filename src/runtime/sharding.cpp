// Sequence sharding helpers (docs/DESIGN.md §2): shard, unshard and gather along the sequence.
#include <algorithm>

#include <ATen/ATen.h>

#include "core/device.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"

namespace mlacp {
namespace {

// Host-made indices on the tensor's device, without synchronising the host.
at::Tensor indices(const std::vector<int64_t>& v, const at::Device& device) {
  return host_to_device(at::tensor(v, at::TensorOptions().dtype(at::kLong)), device);
}

// Token order of the concatenated shards of ranks 0..P-1, and its inverse.
std::vector<int64_t> shard_order(CpPartition partition, int64_t seq_len, int64_t cp) {
  std::vector<int64_t> order;
  for (int64_t r = 0; r < cp; ++r) {
    const auto tokens = shard_token_indices(partition, seq_len, cp, r);
    order.insert(order.end(), tokens.begin(), tokens.end());
  }
  return order;
}

at::Tensor unshard_concatenated(const at::Tensor& concatenated, CpPartition partition, int64_t cp, int64_t seq_dim) {
  const int64_t seq_len = concatenated.size(seq_dim);
  const std::vector<int64_t> order = shard_order(partition, seq_len, cp);
  std::vector<int64_t> inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
  return concatenated.index_select(seq_dim, indices(inverse, concatenated.device()));
}

}  // namespace

at::Tensor shard_sequence(const at::Tensor& global, CpPartition partition, int64_t cp, int64_t cp_rank,
                          int64_t seq_dim) {
  return global.index_select(seq_dim,
                             indices(shard_token_indices(partition, global.size(seq_dim), cp, cp_rank), global.device()));
}

at::Tensor unshard_sequence(const std::vector<at::Tensor>& shards, CpPartition partition, int64_t seq_dim) {
  return unshard_concatenated(at::cat(shards, seq_dim), partition, static_cast<int64_t>(shards.size()), seq_dim);
}

at::Tensor gather_sequence(const CommGroup& cp_group, const at::Tensor& local, CpPartition partition, int64_t seq_dim) {
  at::NoGradGuard no_grad;
  at::Tensor moved = local.detach().movedim(seq_dim, 1);  // [B, S_l, ...]
  at::Tensor gathered = launch_all_gather_seq(cp_group, moved, "gather_sequence").wait_one();  // [B, S, ...]
  return unshard_concatenated(gathered, partition, cp_group.size(), 1).movedim(1, seq_dim);
}

std::vector<int64_t> shard_document_ends(const std::vector<int64_t>& global_ends, CpPartition partition,
                                         int64_t seq_len, int64_t cp, int64_t cp_rank) {
  const std::vector<int64_t> tokens = shard_token_indices(partition, seq_len, cp, cp_rank);
  auto document_of = [&](int64_t t) {
    return std::upper_bound(global_ends.begin(), global_ends.end(), t) - global_ends.begin();
  };
  std::vector<int64_t> local_ends;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool last = i + 1 == tokens.size();
    if (last || document_of(tokens[i + 1]) != document_of(tokens[i]) || tokens[i + 1] != tokens[i] + 1)
      local_ends.push_back(static_cast<int64_t>(i) + 1);
  }
  return local_ends;
}

}  // namespace mlacp
