// The overlap schedules of SPEC §5: collectives launched in one step and waited in a later one,
// forward and backward, built from custom autograd nodes that share small state records (the
// autograd engine's order is what makes "launch in one node, wait in a later node" work).
// Results equal the plain schedule's (cp_attention.cpp) up to float64 rounding.
#pragma once

#include <memory>

#include "kernels/segmented_attention.h"
#include "mlacp/attention.h"
#include "mlacp/comm.h"
#include "mlacp/plan.h"

namespace mlacp {

struct ScheduleContext {
  MlaAttentionImpl& module;
  const CpPlan& plan;
  const ParallelGroups& groups;
  const AttentionStructure* structure = nullptr;  // the attention's rows (schedules that run attention)
};

struct ScheduledInputs {
  at::Tensor query;  // [B, Sq, Hc, Dqk]
  at::Tensor key;    // [B, Sk, Hc, Dqk]
  at::Tensor value;  // [B, Sk, Hc, Dv]
  at::Tensor gate;   // [B, S_l, H*Dv] sigmoid(o_gate_proj(x)) when the schedule computed it, else undefined
  at::Tensor attention;  // [B, Hc, Sq, Dv] when the schedule ran the attention itself, else undefined
};

// Expanded, pure Ulysses (A = 1):
//   forward:  kv_b_proj | launch V | build K, launch K | q_b_proj+RoPE | launch Q | [gate proj] | wait Q,K,V
//   backward: launch dQ,dK,dV | (no gate) wait dQ, q_b_proj/RoPE bwd under dK,dV | wait dK | wait dV
//             (gate) gate bwd under dQ | wait dQ | ...
ScheduledInputs overlapped_expanded_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                           const at::Tensor& hidden, const at::Tensor& rope_positions,
                                           const at::Tensor& key_rope);
// Expanded hybrid (A > 1): forward launches overlap (K/V exchange under Q, K/V gather under the Q
// exchange); backward is the plain one.
ScheduledInputs overlapped_expanded_hybrid_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                                  const at::Tensor& rope_positions, const at::Tensor& key_rope);
// Latent (any U):
//   forward:  launch latent gather | q_b_proj+RoPE | wait gather | launch Q | kv_b_proj(head rows) |
//             [blockwise kernel: attention of this rank's own query rows] | wait Q | [the other rows]
//   backward: launch dQ | kv_b_proj dgrad, launch reduce-scatter | kv_b_proj wgrad | wait RS | wait dQ
ScheduledInputs overlapped_latent_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                         const at::Tensor& rope_positions, const at::Tensor& key_rope);
// Latent strategy, blockwise kernel: the attention of this rank's own query rows (its head block
// of the local Q [B,S_l,H,Dqk], here before the Q exchange completes) computed now; the other
// rows by finish(). Both schedules split the rows this way, so their results are identical to
// the bit. Null for the naive kernel or without a structure in ctx.
std::unique_ptr<SegmentedAttention> own_rows_attention(const ScheduleContext& ctx, const at::Tensor& query_local,
                                                       const at::Tensor& key, const at::Tensor& value);
inline at::Tensor finish_rows_attention(SegmentedAttention& attention, const at::Tensor& q_heads,
                                        const at::Tensor& key, const at::Tensor& value) {
  return attention.finish(q_heads.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2));  // [B,Hc,Sq,Dv]
}

// Output (U > 1): restore head->seq, gate, o_proj.
//   backward: o_proj dgrad | launch dO | gate grad, wgrad | restore waits dO
// The restore and the projection share a state record: the projection launches dO, the restore
// waits it. o_proj must be the only consumer of the restored output; a second one is an error
// in backward (its gradient would otherwise be lost silently).
struct OutputExchange;
struct RestoredOutput {
  at::Tensor restored;  // [B, S_l, H*Dv]
  std::shared_ptr<OutputExchange> exchange;
};
RestoredOutput overlapped_restore(const ScheduleContext& ctx, const at::Tensor& attention);
at::Tensor overlapped_projection(const ScheduleContext& ctx, const RestoredOutput& restored, const at::Tensor& hidden,
                                 const at::Tensor& gate);
inline at::Tensor overlapped_output(const ScheduleContext& ctx, const at::Tensor& attention, const at::Tensor& hidden,
                                    const at::Tensor& gate) {
  return overlapped_projection(ctx, overlapped_restore(ctx, attention), hidden, gate);
}

}  // namespace mlacp
