// The plain schedule of the context-parallel core (every collective waited right after launch):
//
//   hidden [B,S_l,d] --copy_to_tp--> latents --> Q [B,S_l,H,Dqk], rotated k_rope [B,S_l,Dr]
//   expanded_ulysses:  K,V for all H heads; {Q,K,V} --seq->head (U)--> [B,U*S_l,Hc,*]
//                      (A > 1: [K|V] --all-gather (A)--> [B,S,Hc,*])
//   latent_kv_head:    Q --seq->head (U)--> [B,U*S_l,Hc,Dqk]
//                      [kv_latent|k_rope] --all-gather (P)--> [B,S,Rkv+Dr] --> K,V of heads [u*Hc,(u+1)*Hc)
//   attention over (query rows = Ulysses block tokens, key rows = all tokens) --> [B,U*S_l,Hc,Dv]
//   --head->seq (U)--> [B,S_l,H*Dv] --> gate, o_proj (row-parallel sum over TP)
#include "runtime/cp_attention.h"

#include <tuple>

#include <ATen/ATen.h>

#include "core/format.h"
#include "kernels/attend.h"
#include "mlacp/errors.h"
#include "model/forward_inputs.h"
#include "core/timeline.h"
#include "runtime/collective_ops.h"
#include "runtime/overlap_schedule.h"

namespace mlacp {
namespace {
constexpr const char* kWhat = "CP forward";
}

CpAttentionCore::CpAttentionCore(CpPlan plan, ParallelGroups groups) : plan_(std::move(plan)), groups_(std::move(groups)) {}

std::string CpAttentionCore::describe() const { return "context parallel: " + plan_.to_json(); }

CpAttentionCore::Rows CpAttentionCore::rows_for(int64_t seq_len, const at::Device& device) const {
  const int64_t p = plan_.cp(), u = plan_.ulysses(), a = plan_.all_gather_rank(groups_.cp_rank);
  std::vector<int64_t> query, key;
  for (int64_t r = 0; r < p; ++r) {
    const std::vector<int64_t> tokens = shard_token_indices(plan_.partition(), seq_len, p, r);
    key.insert(key.end(), tokens.begin(), tokens.end());
    if (r / u == a) query.insert(query.end(), tokens.begin(), tokens.end());
  }
  auto to_tensor = [&](const std::vector<int64_t>& v) {
    return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device);
  };
  return {to_tensor(query), to_tensor(key)};
}

ScheduledInputs CpAttentionCore::expanded_inputs(MlaAttentionImpl& m, const LocalLatents& latents,
                                                                  const at::Tensor& query, const at::Tensor& key_rope) {
  const MlaConfig& c = m.config();
  at::Tensor key, value;
  {
    ComputeSpan span(groups_.timeline.get(), "kv_b_proj");  // same span names as the overlap schedules
    std::tie(key, value) = m.expand_key_value(latents.kv_latent, key_rope, 0, m.local_heads());  // [B,S_l,H,*]
  }
  std::vector<at::Tensor> qkv = seq_to_head(groups_.ulysses, {query, key, value}, "qkv");    // [B,U*S_l,Hc,*]
  ScheduledInputs in{qkv[0], qkv[1], qkv[2], {}};
  if (plan_.all_gather() > 1) {
    at::Tensor kv = all_gather_seq(groups_.all_gather, at::cat({in.key, in.value}, -1), "kv");  // [B,S,Hc,Dqk+Dv]
    std::vector<at::Tensor> parts = kv.split_with_sizes({c.qk_head_dim(), c.v_head_dim}, -1);
    in.key = parts[0];
    in.value = parts[1];
  }
  return in;
}

ScheduledInputs CpAttentionCore::latent_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                               const at::Tensor& query, const at::Tensor& key_rope) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  at::Tensor q = seq_to_head(groups_.ulysses, {query}, "q")[0];                              // [B,U*S_l,Hc,Dqk]
  at::Tensor payload = at::cat({latents.kv_latent, key_rope.to(latents.kv_latent.scalar_type())}, -1);  // [B,S_l,Rkv+Dr]
  at::Tensor gathered = all_gather_seq(groups_.cp, payload, "latent");                       // [B,S,Rkv+Dr]
  const int64_t begin = plan_.head_begin(groups_.cp_rank);
  std::vector<at::Tensor> parts = gathered.split_with_sizes({c.kv_lora_rank, c.qk_rope_head_dim}, -1);
  at::Tensor key, value;
  {
    ComputeSpan span(groups_.timeline.get(), "kv_b_proj");
    std::tie(key, value) = m.expand_key_value(parts[0], parts[1], begin, begin + plan_.compute_heads());  // [B,S,Hc,*]
  }
  // The same row split as the overlap schedule (identical results), without anything in flight.
  std::unique_ptr<SegmentedAttention> attention = own_rows_attention(ctx, query, key, value);
  if (!attention) return {q, key, value};
  ComputeSpan span(groups_.timeline.get(), "attention");
  return {q, key, value, {}, finish_rows_attention(*attention, q, key, value)};
}

at::Tensor CpAttentionCore::restore_output(const at::Tensor& attention, int64_t batch, int64_t local_len) {
  at::Tensor restored = head_to_seq(groups_.ulysses, attention, "o");  // [B,S_l,H,Dv]
  const std::vector<int64_t> expected{batch, local_len, plan_.local_heads(), plan_.dims().value_dim};
  MLACP_REQUIRE(restored.sizes().vec() == expected, kWhat, "output shape mismatch after the head->seq restore",
                {got("shape", shape_text(restored)), got("expected", shape_text(expected))},
                "this is an internal error: report it with the plan (mlacp plan)");
  return restored.reshape({batch, local_len, plan_.local_heads() * plan_.dims().value_dim});  // [B,S_l,H*Dv]
}

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

  // --- compute ---
  at::Tensor x = copy_to_tp(groups_.tp, hidden, "hidden");
  const LocalLatents latents = m.compute_latents(x);
  at::Tensor key_rope = m.rotate_key(latents.key_rope_raw, r.rope_positions);  // [B,S_l,Dr]
  const bool overlap = plan_.overlap() && plan_.cp() > 1;
  const bool expanded = plan_.strategy() == CpStrategy::expanded_ulysses;
  const Rows rows = rows_for(seq_len, hidden.device());
  AttentionStructure structure;
  structure.causal = r.causal;
  structure.query_token_index = rows.query_tokens;
  structure.key_token_index = rows.key_tokens;
  structure.document_ends = r.document_ends;
  if (r.mask.defined()) structure.mask = r.mask.index_select(2, rows.query_tokens).index_select(3, rows.key_tokens);
  const ScheduleContext ctx{m, plan_, groups_, &structure};
  ScheduledInputs in;
  if (overlap) {
    in = !expanded                    ? overlapped_latent_inputs(ctx, latents, r.rope_positions, key_rope)
         : plan_.all_gather() == 1    ? overlapped_expanded_inputs(ctx, latents, x, r.rope_positions, key_rope)
                                      : overlapped_expanded_hybrid_inputs(ctx, latents, r.rope_positions, key_rope);
  } else {
    at::Tensor query;
    {
      ComputeSpan span(groups_.timeline.get(), "q_b_proj_rope");
      query = m.expand_query(latents.query_latent, r.rope_positions);  // [B,S_l,H,Dqk]
    }
    in = expanded ? expanded_inputs(m, latents, query, key_rope) : latent_inputs(ctx, latents, query, key_rope);
  }
  at::Tensor out = in.attention;  // the schedule may have run it (latent: own rows under the Q exchange)
  if (!out.defined()) {
    ComputeSpan span(groups_.timeline.get(), "attention");
    out = attend(plan_.kernel(), in.query.transpose(1, 2), in.key.transpose(1, 2), in.value.transpose(1, 2),
                 m.scaling(), structure);  // [B,Hc,Sq,Dv]
  }
  if (overlap && plan_.ulysses() > 1) return overlapped_output(ctx, out.transpose(1, 2), x, in.gate);
  at::Tensor restored = restore_output(out.transpose(1, 2), batch, local_len);  // [B,S_l,H*Dv]
  if (plan_.tp() == 1) return m.project_output(restored, x);
  return m.project_output(restored, x, [this](const at::Tensor& partial) {
    return all_reduce_sum(groups_.tp, partial, "o_proj");
  });
}

}  // namespace mlacp
