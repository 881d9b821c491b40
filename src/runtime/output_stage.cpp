#include "runtime/output_stage.h"

#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/format.h"
#include "core/stage.h"
#include "core/timeline.h"
#include "mlacp/errors.h"
#include "model/mla_layer.h"
#include "runtime/collective_ops.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "CP output stage";

// [B, S_l, H, Dv] after the restore: the shape the plan promises, checked once for both forms.
at::Tensor flatten_restored(const ScheduleContext& ctx, const at::Tensor& restored, const LocalStep& step) {
  const std::vector<int64_t> expected{step.batch, step.local_len, ctx.plan.local_heads(), ctx.plan.dims().value_dim};
  MLACP_REQUIRE(restored.sizes().vec() == expected, kWhat, "output shape mismatch after the head->seq restore",
                {got("shape", shape_text(restored)), got("expected", shape_text(expected))},
                "this is an internal error: report it with the plan (module->parallel_description())");
  return restored.reshape({step.batch, step.local_len, expected[2] * expected[3]});  // [B,S_l,H*Dv]
}

at::Tensor plain_output(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& attention) {
  MlaAttentionImpl& m = ctx.module;
  at::Tensor restored = flatten_restored(ctx, head_to_seq(ctx.groups.ulysses, attention, Transfer::o), step);
  if (ctx.plan.tp() == 1) return MlaLayer::project_output(m, restored, step.hidden);
  return MlaLayer::project_output(m, restored, step.hidden, [&ctx](const at::Tensor& partial) {
    return all_reduce_sum(ctx.groups.tp, partial, "o_proj");
  });
}

at::Tensor overlapped_output(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& attention,
                             const at::Tensor& given_gate) {
  MlaAttentionImpl& m = ctx.module;
  const CommGroup& ulysses = ctx.groups.ulysses;
  Timeline* tl = ctx.groups.instruments.timeline.get();
  const bool tp = ctx.plan.tp() > 1;

  // --- forward ---
  at::Tensor restored;  // [B,S_l,H*Dv]
  {
    at::NoGradGuard no_grad;
    restored = flatten_restored(
        ctx, launch_head_to_seq(ulysses, attention.detach(), transfer_name(Transfer::o)).wait_one(), step);
  }
  std::shared_ptr<Stage> gate_stage;  // the gate, when the schedule did not compute it
  at::Tensor gate = given_gate;
  if (m.config().output_gate && !gate.defined()) {
    gate_stage = mlacp::gate_stage(ctx, step);
    gate = gate_stage->output(0);
  }
  at::Tensor weight = m.o_proj->weight, bias = tp ? at::Tensor() : m.o_proj->bias;
  at::Tensor projected, y;  // [B,S_l,H*Dv], [B,S_l,d]
  {
    ComputeSpan span(tl, "o_proj");
    at::NoGradGuard no_grad;
    projected = gate.defined() ? restored * gate.detach() : restored;
    y = at::linear(projected, weight.detach(), bias.defined() ? bias.detach() : at::Tensor());
  }

  // --- the node: inputs attention, weight, [bias], [gate | gate_proj's inputs] ---
  const bool has_bias = bias.defined(), has_gate = gate.defined(), own_gate = gate_stage && gate_stage->requires_grad();
  std::vector<at::Tensor> inputs{attention, weight};
  if (has_bias) inputs.push_back(bias);
  if (has_gate && !own_gate) inputs.push_back(gate);
  if (own_gate) append(inputs, gate_stage->inputs());
  const bool needs_attention = attention.requires_grad(), needs_weight = weight.requires_grad();
  const bool needs_bias = has_bias && bias.requires_grad(), needs_gate = has_gate && gate.requires_grad();
  const SavedForBackward saved({restored, has_gate ? gate.detach() : at::Tensor(), weight.detach(), projected},
                               {"restored output", "gate", "o_proj.weight", "gated output"});
  const compat::AutocastSnapshot autocast = compat::AutocastSnapshot::capture(restored.device().type());
  const int64_t heads = ctx.plan.local_heads(), dv = ctx.plan.dims().value_dim;
  const std::vector<int64_t> attention_shape = attention.sizes().vec();
  BackwardFn backward = [=](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    saved.check(kWhat);
    const auto autocast_guard = autocast.enter();
    const at::Tensor &restored_s = saved[0], &gate_s = saved[1], &weight_s = saved[2], &projected_s = saved[3];
    const at::Tensor d_y = g[0].reshape({-1, g[0].size(-1)});  // [B*S_l, d]
    at::Tensor d_projected, d_restored, d_weight, d_bias, d_gate;
    AsyncHandle d_o;
    if (needs_attention || needs_gate) {  // 1. o_proj dgrad
      ComputeSpan span(tl, "o_proj_dgrad");
      d_projected = d_y.mm(weight_s).view(restored_s.sizes());
    }
    if (needs_attention) {  // 2. launch dO: flies under the rest
      d_restored = (has_gate ? d_projected * gate_s : d_projected).to(restored_s.scalar_type());
      const auto& s = restored_s.sizes();
      d_o = launch_seq_to_head(ulysses, d_restored.view({s[0], s[1], heads, dv}), transfer_name(Transfer::d_o));
    }
    if (needs_gate) d_gate = d_projected * restored_s;  // 3. gate grad
    if (needs_weight) {                                  // 4. o_proj wgrad ([out, in], like the weight)
      ComputeSpan span(tl, "o_proj_wgrad");
      d_weight = d_y.t().mm(projected_s.reshape({-1, projected_s.size(-1)})).to(weight_s.scalar_type());
    }
    if (needs_bias) d_bias = d_y.sum(0).to(weight_s.scalar_type());
    std::vector<at::Tensor> gate_grads;  // 5. gate_proj backward
    if (own_gate) gate_grads = gate_stage->backprop({d_gate});
    at::Tensor d_attention;
    if (needs_attention) d_attention = d_o.wait_one().view(attention_shape);  // 6. wait dO
    std::vector<at::Tensor> out{d_attention, d_weight};
    if (has_bias) out.push_back(d_bias);
    if (has_gate && !own_gate) out.push_back(d_gate);
    append(out, gate_grads);
    return out;
  };
  y = attach_backward(inputs, {y}, "OverlappedOutput", std::move(backward))[0];
  if (!tp) return y;
  y = all_reduce_sum(ctx.groups.tp, y, "o_proj");
  return m.o_proj->bias.defined() ? y + m.o_proj->bias : y;
}

}  // namespace

at::Tensor output_stage(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& attention,
                        const at::Tensor& gate, bool overlap) {
  if (overlap && ctx.plan.ulysses() > 1) return overlapped_output(ctx, step, attention, gate);
  return plain_output(ctx, step, attention);
}

}  // namespace mlacp
