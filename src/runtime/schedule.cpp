// The schedule chosen for a plan, and the names of the transfers.
#include "runtime/schedule.h"

#include <ATen/ATen.h>

#include "core/timeline.h"
#include "kernels/attend.h"
#include "mlacp/errors.h"
#include "model/mla_layer.h"

namespace mlacp {

// Defined next to each schedule (one file per strategy).
std::unique_ptr<CpSchedule> make_expanded_ulysses_schedule(bool overlap, bool gate);
std::unique_ptr<CpSchedule> make_expanded_hybrid_schedule(bool overlap, bool ulysses);
std::unique_ptr<CpSchedule> make_latent_schedule(bool overlap, bool ulysses, bool own_rows, bool kv_recompute);

std::unique_ptr<CpSchedule> make_schedule(const CpPlan& plan, const MlaConfig& config, c10::DeviceType device) {
  const bool overlap = plan.overlap() && plan.cp() > 1;
  // Own query rows first: the CPU blockwise kernel's row segments (docs/DESIGN.md §5, §16).
  // device: the own-rows split is the CPU blockwise kernel's
  const bool own_rows = plan.kernel() == AttentionKernel::blockwise && device == c10::DeviceType::CPU;
  if (plan.strategy() == CpStrategy::latent_kv_head) {
    return make_latent_schedule(overlap, plan.ulysses() > 1, own_rows, plan.kv_recompute());
  }
  if (plan.all_gather() == 1) return make_expanded_ulysses_schedule(overlap, config.output_gate);
  return make_expanded_hybrid_schedule(overlap, plan.ulysses() > 1);
}

std::vector<OverlappedTransfer> overlapped_transfers(const CpPlan& plan, const MlaConfig& config,
                                                     c10::DeviceType device) {
  return make_schedule(plan, config, device)->overlapped_transfers();
}

std::shared_ptr<Stage> query_stage(const ScheduleContext& ctx, const LocalStep& step) {
  ComputeSpan span(ctx.groups.instruments.timeline.get(), "q_b_proj_rope");
  MlaAttentionImpl& m = ctx.module;
  return std::make_shared<Stage>("q_b_proj_rope", std::vector<at::Tensor>{step.latents.query_latent},
                                 MlaLayer::query_parameters(m), [&](const std::vector<at::Tensor>& x) {
                                   return std::vector<at::Tensor>{MlaLayer::expand_query(m, x[0], step.rope)};
                                 });
}

std::shared_ptr<Stage> gate_stage(const ScheduleContext& ctx, const LocalStep& step) {
  ComputeSpan span(ctx.groups.instruments.timeline.get(), "gate_proj");
  MlaAttentionImpl& m = ctx.module;
  return std::make_shared<Stage>("gate_proj", std::vector<at::Tensor>{step.hidden}, MlaLayer::gate_parameters(m),
                                 [&m](const std::vector<at::Tensor>& x) {
                                   return std::vector<at::Tensor>{MlaLayer::gate(m, x[0])};
                                 });
}

LocalQkv expand_local_qkv(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  Timeline* tl = ctx.groups.instruments.timeline.get();
  LocalQkv qkv;
  {
    ComputeSpan span(tl, "q_b_proj_rope");
    qkv.query = MlaLayer::expand_query(m, step.latents.query_latent, step.rope);  // [B,S_l,H,Dqk]
  }
  ComputeSpan span(tl, "kv_b_proj");
  std::tie(qkv.key, qkv.value) =
      MlaLayer::expand_key_value(m, step.latents.kv_latent, step.key_rope, 0, m.local_heads());  // [B,S_l,H,*]
  return qkv;
}

at::Tensor attend_heads(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v) {
  ComputeSpan span(ctx.groups.instruments.timeline.get(), "attention");
  return attend(ctx.plan.kernel(), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx.module.scaling(),
                step.structure)
      .transpose(1, 2);
}

std::string transfer_name(Transfer t) {
  switch (t) {
    case Transfer::q: return "q";
    case Transfer::k: return "k";
    case Transfer::v: return "v";
    case Transfer::qkv: return "qkv";
    case Transfer::kv: return "kv";
    case Transfer::kv_gather: return "kv_gather";
    case Transfer::latent: return "latent";
    case Transfer::o: return "o";
    case Transfer::dq: return "dq";
    case Transfer::dk: return "dk";
    case Transfer::dv: return "dv";
    case Transfer::dqkv: return "dqkv";
    case Transfer::dkv: return "dkv";
    case Transfer::dkv_gather: return "dkv_gather";
    case Transfer::dlatent: return "dlatent";
    case Transfer::d_o: return "dO";
  }
  return "?";
}

Transfer gradient_of(Transfer t) {
  switch (t) {
    case Transfer::q: return Transfer::dq;
    case Transfer::k: return Transfer::dk;
    case Transfer::v: return Transfer::dv;
    case Transfer::qkv: return Transfer::dqkv;
    case Transfer::kv: return Transfer::dkv;
    case Transfer::kv_gather: return Transfer::dkv_gather;
    case Transfer::latent: return Transfer::dlatent;
    case Transfer::o: return Transfer::d_o;
    default: break;
  }
  MLACP_REQUIRE(false, "transfers", "a gradient transfer has no gradient of its own", {got("transfer", transfer_name(t))},
                "pass a forward transfer");
  return t;
}

}  // namespace mlacp
