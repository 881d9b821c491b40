#include "runtime/cp_attention.h"

#include <ATen/ATen.h>

#include "core/device.h"
#include "core/format.h"
#include "mlacp/errors.h"
#include "model/forward_inputs.h"
#include "runtime/collective_ops.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "CP forward";

at::Tensor index_tensor(const std::vector<int64_t>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)); }

// The rows of this rank's attention: query rows = the tokens of its Ulysses block (the U CP ranks
// of its all-gather row, in exchange order), key rows = all tokens in gather order. The token
// indices are host metadata (CPU); a mask's rows are taken on its own device.
AttentionStructure attention_rows(const CpPlan& plan, int64_t cp_rank, int64_t seq_len, const ResolvedForward& r) {
  const int64_t p = plan.cp(), u = plan.ulysses(), a = plan.all_gather_rank(cp_rank);
  std::vector<int64_t> query, key;
  for (int64_t rank = 0; rank < p; ++rank) {
    const std::vector<int64_t> tokens = shard_token_indices(plan.partition(), seq_len, p, rank);
    key.insert(key.end(), tokens.begin(), tokens.end());
    if (rank / u == a) query.insert(query.end(), tokens.begin(), tokens.end());
  }
  AttentionStructure s;
  s.causal = r.causal;
  s.query_token_index = index_tensor(query);  // [U*S_l]
  s.key_token_index = index_tensor(key);      // [S]
  s.document_ends = r.document_ends;
  if (r.mask.defined()) {
    const c10::Device device = r.mask.device();
    s.mask = r.mask.index_select(2, host_to_device(s.query_token_index, device))
                 .index_select(3, host_to_device(s.key_token_index, device));
  }
  return s;
}

}  // namespace

CpAttentionCore::CpAttentionCore(CpPlan plan, ParallelGroups groups, const MlaConfig& config, c10::DeviceType device)
    : plan_(std::move(plan)), groups_(std::move(groups)), schedule_(make_schedule(plan_, config, device)) {}

std::string CpAttentionCore::describe() const { return "context parallel (" + schedule_->name() + "): " + plan_.to_json(); }

at::Tensor CpAttentionCore::forward(MlaAttentionImpl& m, const at::Tensor& hidden, const MlaForwardOptions& options) {
  // --- every check before the first collective ---
  MLACP_REQUIRE(hidden.defined() && hidden.dim() == 3, kWhat, "hidden states must be 3-D [B, S_local, hidden]",
                {got("shape", shape_text(hidden))}, "pass this rank's shard of the batch");
  const int64_t p = plan_.cp(), batch = hidden.size(0), local_len = hidden.size(1), seq_len = local_len * p;
  MLACP_REQUIRE(local_len > 0, kWhat, "hidden states must not be empty", {got("shape", shape_text(hidden))},
                "pass at least one token per rank");
  check_shardable(plan_.partition(), seq_len, p);
  const std::vector<int64_t> tokens = shard_token_indices(plan_.partition(), seq_len, p, groups_.cp_rank);
  const ResolvedForward r = resolve_forward_inputs(m.config(), hidden, options, m.is_training(), seq_len, tokens);

  // --- this rank's local step, then the schedule ---
  LocalStep step;
  step.hidden = copy_to_tp(groups_.tp, hidden);
  step.latents = MlaLayer::compute_latents(m, step.hidden);
  step.rope = MlaLayer::rope_table(m, r);
  step.key_rope = MlaLayer::rotate_key(step.latents.key_rope_raw, step.rope);  // [B,S_l,Dr]
  step.structure = attention_rows(plan_, groups_.cp_rank, seq_len, r);
  step.batch = batch;
  step.local_len = local_len;
  const ScheduleContext ctx{m, plan_, groups_};
  return schedule_->forward(ctx, step);
}

}  // namespace mlacp
