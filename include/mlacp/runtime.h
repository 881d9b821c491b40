// Context parallelism for MlaAttention (docs/DESIGN.md §2-§8): one call installs it on a module,
// helpers shard and unshard sequences and reduce gradients for a trainer.
//
//   ParallelGroups groups = create_parallel_groups(world_from_env(), {dp, cp, tp, ulysses}, {});
//   MlaAttention attn(config);                                  // same seed on every rank
//   CpPlan plan = parallelize(attn, groups, {CpStrategy::latent_kv_head, CpPartition::head_tail});
//   at::Tensor y = attn->forward(shard_sequence(x, plan.partition(), cp, groups.cp_rank), options);
//   ... backward ...
//   reduce_gradients(attn->named_parameters(), groups);         // docs/DESIGN.md §7
#pragma once

#include <string>
#include <vector>

#include <torch/ordered_dict.h>

#include "mlacp/comm.h"
#include "mlacp/attention.h"
#include "mlacp/plan.h"

namespace mlacp {

// How a module runs with context parallelism (the plan's free choices; the degrees come from the
// groups).
struct CpOptions {
  CpStrategy strategy = CpStrategy::latent_kv_head;
  CpPartition partition = CpPartition::head_tail;
  bool overlap = true;
  AttentionKernel kernel = AttentionKernel::blockwise;
  bool kv_recompute = false;  // CpPlanSpec::kv_recompute (latent strategy, CPU blockwise kernel)
};

// The one entry point: shards the module's heads over TP when the groups have tp > 1 (unless
// already sharded for that degree), builds the plan from the module's config and the groups'
// shape, validates the install (docs/DESIGN.md §8), compares the plan's fingerprint across the CP and TP
// groups (the first collective; a mismatch is an error on every rank, not a hang), then installs
// the schedule of the plan's strategy. Parameters are kept (same objects). Returns the plan.
// After this, module->forward takes this rank's shard [B, S_l, d] with *global* document ends
// and masks.
CpPlan parallelize(MlaAttention& module, const ParallelGroups& groups, const CpOptions& options = {});

// The transfers of a schedule, named once: the byte counters, the timeline, the bench and the
// schedules' overlap declarations all use transfer_name().
enum class Transfer {
  q, k, v,        // expanded: Q, K, V seq->head (overlapped form: one exchange each)
  qkv,            // expanded, plain form: Q, K, V packed in one seq->head exchange
  kv,             // expanded hybrid, overlapped form: K|V seq->head
  kv_gather,      // expanded hybrid: K|V all-gather over the all-gather group
  latent,         // latent: [kv_latent | k_rope] all-gather over the CP group
  o,              // output restore head->seq
  dq, dk, dv, dqkv, dkv, dkv_gather, dlatent, d_o,  // their adjoints in backward
};
std::string transfer_name(Transfer transfer);  // "q", ..., "dlatent", "dO"
Transfer gradient_of(Transfer transfer);       // q -> dq, latent -> dlatent, o -> d_o, ...

// A transfer an overlapped schedule hides, and the computation it is launched before (its
// timeline span names, in order).
struct OverlappedTransfer {
  Transfer transfer;
  std::vector<std::string> under;
};
// What the overlapped form of the plan's schedule hides (empty when it has no overlapped form
// for these degrees).
// `device`: where the layer runs (the CPU's blockwise kernel attends a rank's own query rows under
// the Q exchange; a GPU's stream overlaps the exchange with the K/V up-projection only).
std::vector<OverlappedTransfer> overlapped_transfers(const CpPlan& plan, const MlaConfig& config,
                                                     c10::DeviceType device);

// The plan for a module's config and a mesh shape.
CpPlanSpec plan_spec_for(const MlaConfig& config, const MeshShape& shape, CpStrategy strategy, CpPartition partition,
                         bool overlap);

// The install step of parallelize() for a plan built by hand (TP sharding already applied):
// validation, fingerprint comparison, install.
void install_context_parallel(MlaAttention& module, const CpPlan& plan, const ParallelGroups& groups);

// Shard / unshard along the sequence dim for a partition (docs/DESIGN.md §2).
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

// docs/DESIGN.md §7: sums every parameter's gradient over CP (each rank saw other tokens) and DP, and
// additionally over TP for parameters whose TP ranks hold partial gradients (`skips_tp_reduction`
// says which do not).
// Parameters without a gradient are skipped on every rank alike (frozen sets must agree).
void reduce_gradients(const torch::OrderedDict<std::string, at::Tensor>& parameters, const ParallelGroups& groups,
                      const std::function<bool(const std::string&)>& skips_tp_reduction =
                          MlaAttentionImpl::skips_tp_reduction);

}  // namespace mlacp
