// The expanded strategy, hybrid (A > 1; docs/DESIGN.md §4, §5): a Ulysses seq->head exchange
// inside each group of U consecutive CP ranks, then an all-gather of the expanded K|V of that head
// block across the A groups.
//
// Plain form (each collective waited at once; autograd runs each step's adjoint in reverse):
//   q_b_proj+RoPE | kv_b_proj | Q,K,V seq->head (packed) | K|V all-gather | attention | output
//
// Overlapped form: one node from the latents to (Q, K, V heads):
//   forward:   kv_b_proj | launch K|V exchange | q_b_proj+RoPE | launch Q | wait K|V |
//              launch K|V gather | wait Q | wait gather | attention | output
//   backward:  (output, attention backward) | launch dQ | reduce-scatter dK|V over the gather group
//              (waited) | launch dK|V head->seq | wait dQ | q_b_proj+RoPE backward | wait dK|V |
//              kv_b_proj backward
#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "core/stage.h"
#include "core/timeline.h"
#include "kernels/attend.h"
#include "model/mla_layer.h"
#include "runtime/collective_ops.h"
#include "runtime/output_stage.h"
#include "runtime/schedule.h"

namespace mlacp {
namespace {

class ExpandedHybridSchedule final : public CpSchedule {
 public:
  ExpandedHybridSchedule(bool overlap, bool ulysses) : overlap_(overlap), ulysses_(ulysses) {}
  std::string name() const override { return overlap_ ? "expanded_ulysses hybrid (overlapped)" : "expanded_ulysses hybrid (plain)"; }
  std::vector<OverlappedTransfer> overlapped_transfers() const override {
    if (!overlap_ || !ulysses_) return {};  // U = 1: the exchanges move nothing, the gather hides under nothing
    return {{Transfer::kv, {"q_b_proj_rope"}}, {Transfer::d_o, {"o_proj_wgrad"}}};
  }
  at::Tensor forward(const ScheduleContext& ctx, const LocalStep& step) override {
    return overlap_ ? overlapped(ctx, step) : plain(ctx, step);
  }

 private:
  at::Tensor plain(const ScheduleContext& ctx, const LocalStep& step);
  at::Tensor overlapped(const ScheduleContext& ctx, const LocalStep& step);
  bool overlap_, ulysses_;  // ulysses_: U > 1
};

at::Tensor ExpandedHybridSchedule::plain(const ScheduleContext& ctx, const LocalStep& step) {
  const MlaConfig& c = ctx.module.config();
  const LocalQkv local = expand_local_qkv(ctx, step);  // [B,S_l,H,*]
  std::vector<at::Tensor> qkv =
      seq_to_head(ctx.groups.ulysses, {local.query, local.key, local.value}, Transfer::qkv);  // [B,U*S_l,Hc,*]
  at::Tensor kv = all_gather_seq(ctx.groups.all_gather, at::cat({qkv[1], qkv[2]}, -1), Transfer::kv_gather);  // [B,S,Hc,Dqk+Dv]
  std::vector<at::Tensor> parts = kv.split_with_sizes({c.qk_head_dim(), c.v_head_dim}, -1);
  return output_stage(ctx, step, attend_heads(ctx, step, qkv[0], parts[0], parts[1]), {}, /*overlap=*/false);
}

at::Tensor ExpandedHybridSchedule::overlapped(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup &ulysses = ctx.groups.ulysses, &gather_group = ctx.groups.all_gather;
  Timeline* tl = ctx.groups.instruments.timeline.get();

  // --- forward ---
  std::shared_ptr<Stage> kv_stage, query_stage;
  {
    ComputeSpan span(tl, "kv_b_proj");
    kv_stage = std::make_shared<Stage>("kv_b_proj", std::vector<at::Tensor>{step.latents.kv_latent, step.key_rope},
                                       MlaLayer::kv_parameters(m), [&m](const std::vector<at::Tensor>& x) {
                                         auto [key, value] = MlaLayer::expand_key_value(m, x[0], x[1], 0, m.local_heads());
                                         return std::vector<at::Tensor>{at::cat({key, value}, -1)};  // [B,S_l,H,Dqk+Dv]
                                       });
  }
  AsyncHandle kv_exchange, q_exchange, kv_gather;
  {
    at::NoGradGuard no_grad;
    kv_exchange = launch_seq_to_head(ulysses, kv_stage->output(0).detach(), transfer_name(Transfer::kv));
  }
  query_stage = mlacp::query_stage(ctx, step);  // [B,S_l,H,Dqk]
  at::Tensor q_heads, kv_all;
  {
    at::NoGradGuard no_grad;
    q_exchange = launch_seq_to_head(ulysses, query_stage->output(0).detach(), transfer_name(Transfer::q));
    kv_gather = launch_all_gather_seq(gather_group, kv_exchange.wait_one(), transfer_name(Transfer::kv_gather));
    q_heads = q_exchange.wait_one();  // [B,U*S_l,Hc,Dqk]
    kv_all = kv_gather.wait_one();    // [B,S,Hc,Dqk+Dv]
  }

  // --- the node: inputs kv_latent, key_rope, kv_b_proj, query_latent, query params ---
  std::vector<at::Tensor> inputs = kv_stage->inputs();
  append(inputs, query_stage->inputs());
  const bool needs_q = query_stage->requires_grad(), needs_kv = kv_stage->requires_grad();
  const size_t kv_inputs = kv_stage->inputs().size(), query_inputs = query_stage->inputs().size();
  BackwardFn backward = [=](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    // g: d Q heads, d K|V of all tokens
    AsyncHandle d_q, d_kv;
    if (needs_q) d_q = launch_head_to_seq(ulysses, g[0], transfer_name(Transfer::dq));  // 1. launch dQ
    if (needs_kv) {  // 2. reduce-scatter dK|V over the gather group (waited), 3. launch its head->seq
      at::Tensor local = launch_reduce_scatter_seq(gather_group, g[1], transfer_name(Transfer::dkv_gather)).wait_one();
      g[1] = at::Tensor();
      d_kv = launch_head_to_seq(ulysses, local, transfer_name(Transfer::dkv));
    }
    std::vector<at::Tensor> query_grads(query_inputs);  // 4. wait dQ, q_b_proj+RoPE backward
    if (needs_q) query_grads = query_stage->backprop({d_q.wait_one()});
    std::vector<at::Tensor> kv_grads(kv_inputs);  // 5. wait dK|V, kv_b_proj backward
    if (needs_kv) kv_grads = kv_stage->backprop({d_kv.wait_one()});
    std::vector<at::Tensor> out = kv_grads;
    append(out, query_grads);
    return out;
  };
  std::vector<at::Tensor> outputs = attach_backward(inputs, {q_heads, kv_all}, "ExpandedHybridSchedule", std::move(backward));
  kv_stage->release_outputs();  // the local Q and K|V have been sent: only the exchanged ones stay
  query_stage->release_outputs();
  std::vector<at::Tensor> parts = outputs[1].split_with_sizes({c.qk_head_dim(), c.v_head_dim}, -1);
  return output_stage(ctx, step, attend_heads(ctx, step, outputs[0], parts[0], parts[1]), {}, /*overlap=*/true);
}

}  // namespace

std::unique_ptr<CpSchedule> make_expanded_hybrid_schedule(bool overlap, bool ulysses) {
  return std::make_unique<ExpandedHybridSchedule>(overlap, ulysses);
}

}  // namespace mlacp
