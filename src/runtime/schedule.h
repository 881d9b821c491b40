// The CP schedules: one type per strategy, chosen once when CP is installed (make_schedule), each
// in its own file with its plain and overlapped forms side by side (docs/DESIGN.md §4, §5):
//   expanded_ulysses.cpp   expanded K/V, pure Ulysses (A = 1)
//   expanded_hybrid.cpp    expanded K/V, Ulysses x all-gather (A > 1)
//   latent.cpp             the latent all-gather, K/V expanded per head block (any U)
// and the output stage they share (output_stage.cpp). The plain form waits every collective right
// after launching it and lets autograd run the adjoint of each step in reverse; the overlapped
// form is one autograd node per schedule whose backward is written out in execution order.
// Both forms give results identical to the bit.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/stage.h"
#include "kernels/reference_attention.h"
#include "kernels/rope.h"
#include "mlacp/attention.h"
#include "mlacp/comm.h"
#include "mlacp/plan.h"
#include "mlacp/runtime.h"

namespace mlacp {

// What every schedule reads, fixed when CP is installed.
struct ScheduleContext {
  MlaAttentionImpl& module;
  const CpPlan& plan;
  const ParallelGroups& groups;
};

// One forward's local inputs, after validation, on this rank's tokens.
struct LocalStep {
  LocalLatents latents;       // [B,S_l,Rq|d], [B,S_l,Rkv], [B,S_l,Dr]
  at::Tensor hidden;          // [B,S_l,d] (after the TP entry): the gate reads it
  RopeTable rope;  // the local tokens' rotation
  at::Tensor key_rope;        // [B,S_l,Dr] rotated
  AttentionStructure structure;  // query rows = this rank's Ulysses block's tokens, keys = all tokens
  int64_t batch = 0, local_len = 0;
};

class CpSchedule {
 public:
  virtual ~CpSchedule() = default;
  // hidden's latents -> this rank's output [B, S_l, d].
  virtual at::Tensor forward(const ScheduleContext& ctx, const LocalStep& step) = 0;
  // The transfers the overlapped form hides and the computation each sits under.
  virtual std::vector<OverlappedTransfer> overlapped_transfers() const = 0;
  virtual std::string name() const = 0;
};

// `device`: where the module's tensors live (the schedule's row split follows the kernel there).
std::unique_ptr<CpSchedule> make_schedule(const CpPlan& plan, const MlaConfig& config, c10::DeviceType device);

// --- steps several schedules share (schedule.cpp) ---
// q_b_proj+RoPE of this rank's tokens [B,S_l,H,Dqk] as a Stage (the overlapped forms), span
// "q_b_proj_rope".
std::shared_ptr<Stage> query_stage(const ScheduleContext& ctx, const LocalStep& step);
// sigmoid(o_gate_proj(hidden)) [B,S_l,H*Dv] as a Stage, span "gate_proj".
std::shared_ptr<Stage> gate_stage(const ScheduleContext& ctx, const LocalStep& step);
// The expanded strategy's local Q, K, V for all of this rank's heads [B,S_l,H,*] (the plain
// forms; spans "q_b_proj_rope", "kv_b_proj").
struct LocalQkv {
  at::Tensor query, key, value;
};
LocalQkv expand_local_qkv(const ScheduleContext& ctx, const LocalStep& step);
// Attention over (Ulysses block rows x all keys): q [B,Sq,Hc,Dqk], k, v [B,Sk,Hc,*] ->
// [B,Sq,Hc,Dv] (span "attention").
at::Tensor attend_heads(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v);

}  // namespace mlacp
