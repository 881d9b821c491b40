// Context parallelism for MlaAttention (SPEC §2-§4, §6-§8): install a plan on a module, shard and
// unshard sequences, reduce gradients for a trainer.
//
//   ParallelGroups groups = create_parallel_groups(world_from_env(), {dp, cp, tp, ulysses}, {});
//   MlaAttention attn(config);                       // same seed on every rank
//   attn->shard_heads_for_tp(groups.tp_rank, tp);    // when tp > 1
//   install_context_parallel(attn, plan, groups);    // parameters kept, same objects
//   at::Tensor y = attn->forward(shard_sequence(x, plan.partition(), cp, groups.cp_rank), options);
//   ... backward ...
//   reduce_gradients(attn->named_parameters(), groups);   // SPEC §7
#pragma once

#include <string>
#include <vector>

#include <torch/ordered_dict.h>

#include "mlacp/comm.h"
#include "mlacp/attention.h"
#include "mlacp/plan.h"

namespace mlacp {

// The plan for a module's config and a mesh shape.
CpPlanSpec plan_spec_for(const MlaConfig& config, const MeshShape& shape, CpStrategy strategy, CpPartition partition,
                         bool overlap);

// Validates the install (SPEC §8: degrees equal the groups' sizes, projections TP-local, not
// installed twice), compares the plan's fingerprint across the CP and TP groups (a mismatch is an
// error on every rank, not a hang), then replaces the module's attention core. After this,
// module->forward takes this rank's shard [B, S_l, d] with *global* document ends and masks.
void install_context_parallel(MlaAttention& module, const CpPlan& plan, const ParallelGroups& groups);

// Shard / unshard along the sequence dim for a partition (SPEC §2).
at::Tensor shard_sequence(const at::Tensor& global, CpPartition partition, int64_t cp, int64_t cp_rank,
                          int64_t seq_dim = 1);
at::Tensor unshard_sequence(const std::vector<at::Tensor>& shards, CpPartition partition, int64_t seq_dim = 1);
// All-gathers every CP rank's shard and unshards: the global tensor on every rank (for checks).
at::Tensor gather_sequence(const CommGroup& cp_group, const at::Tensor& local, CpPartition partition,
                           int64_t seq_dim = 1);
// Document ends of the local tokens in local order: where each run of one document ends inside
// this rank's shard (a document crossing a shard boundary is cut there).
std::vector<int64_t> shard_document_ends(const std::vector<int64_t>& global_ends, CpPartition partition,
                                         int64_t seq_len, int64_t cp, int64_t cp_rank);

// SPEC §7: sums every parameter's gradient over CP (each rank saw other tokens) and DP, and
// additionally over TP for TP-replicated parameters (`is_tp_sharded` says which are not).
// Parameters without a gradient are skipped on every rank alike (frozen sets must agree).
void reduce_gradients(const torch::OrderedDict<std::string, at::Tensor>& parameters, const ParallelGroups& groups,
                      const std::function<bool(const std::string&)>& is_tp_sharded =
                          MlaAttentionImpl::is_tp_sharded_parameter);

}  // namespace mlacp
