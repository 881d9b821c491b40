// The expanded strategy, pure Ulysses (A = 1; docs/DESIGN.md §4, §5): every rank expands K and
// V for all its heads and one seq->head exchange gives each rank all tokens of its head block.
//
// Plain form (each collective waited at once; autograd runs each step's adjoint in reverse):
//   q_b_proj+RoPE | kv_b_proj | Q,K,V seq->head (one packed exchange) | attention | output
//
// Overlapped form: one node from the latents to (Q, K, V heads[, gate]):
//   forward:   kv_b_proj | launch V | build K | launch K | q_b_proj+RoPE | launch Q | [gate_proj] |
//              wait Q, K, V | attention | output
//   backward:  (output, attention backward) | launch dQ, dK, dV | [gate_proj backward] | wait dQ |
//              q_b_proj+RoPE backward | wait dK | build K backward | wait dV | kv_b_proj backward
// Without a gate nothing can hide Q's exchange in forward (it is waited at once).
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

class ExpandedUlyssesSchedule final : public CpSchedule {
 public:
  ExpandedUlyssesSchedule(bool overlap, bool gate) : overlap_(overlap), gate_(gate) {}
  std::string name() const override { return overlap_ ? "expanded_ulysses (overlapped)" : "expanded_ulysses (plain)"; }
  std::vector<OverlappedTransfer> overlapped_transfers() const override {
    if (!overlap_) return {};
    std::vector<OverlappedTransfer> t{{Transfer::v, {"build_k", "q_b_proj_rope"}},
                                      {Transfer::k, {"q_b_proj_rope"}},
                                      {Transfer::dk, {"q_b_proj_rope_backward"}},
                                      {Transfer::dv, {"q_b_proj_rope_backward", "build_k_backward"}},
                                      {Transfer::d_o, {"o_proj_wgrad"}}};
    if (gate_) t.insert(t.begin() + 2, {{Transfer::q, {"gate_proj"}}, {Transfer::dq, {"gate_proj_backward"}}});
    return t;
  }
  at::Tensor forward(const ScheduleContext& ctx, const LocalStep& step) override {
    return overlap_ ? overlapped(ctx, step) : plain(ctx, step);
  }

 private:
  at::Tensor plain(const ScheduleContext& ctx, const LocalStep& step);
  at::Tensor overlapped(const ScheduleContext& ctx, const LocalStep& step);
  bool overlap_, gate_;
};

at::Tensor ExpandedUlyssesSchedule::plain(const ScheduleContext& ctx, const LocalStep& step) {
  const LocalQkv local = expand_local_qkv(ctx, step);  // [B,S_l,H,*]
  std::vector<at::Tensor> qkv =
      seq_to_head(ctx.groups.ulysses, {local.query, local.key, local.value}, Transfer::qkv);  // [B,U*S_l,Hc,*]
  return output_stage(ctx, step, attend_heads(ctx, step, qkv[0], qkv[1], qkv[2]), {}, /*overlap=*/false);
}

at::Tensor ExpandedUlyssesSchedule::overlapped(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  const CommGroup& ulysses = ctx.groups.ulysses;
  Timeline* tl = ctx.groups.instruments.timeline.get();
  const int64_t heads = m.local_heads();
  auto launch = [&](const at::Tensor& x, Transfer t) {
    at::NoGradGuard no_grad;
    return launch_seq_to_head(ulysses, x.detach(), transfer_name(t));
  };

  // --- forward ---
  std::shared_ptr<Stage> kv_stage, key_stage, query_stage, gate_stage;
  {
    ComputeSpan span(tl, "kv_b_proj");
    kv_stage = std::make_shared<Stage>(
        "kv_b_proj", std::vector<at::Tensor>{step.latents.kv_latent}, MlaLayer::kv_parameters(m),
        [&](const std::vector<at::Tensor>& x) {
          auto [weight, bias] = MlaLayer::kv_up_rows(m, 0, heads);
          auto [key_nope, value] = MlaLayer::split_key_value(m, at::linear(x[0], weight, bias));  // [B,S_l,H,*]
          return std::vector<at::Tensor>{key_nope, value};
        });
  }
  const at::Tensor &key_nope = kv_stage->output(0), &value = kv_stage->output(1);
  AsyncHandle v_exchange = launch(value, Transfer::v);  // V flies while K is built
  {
    ComputeSpan span(tl, "build_k");
    key_stage = std::make_shared<Stage>("build_k", std::vector<at::Tensor>{key_nope, step.key_rope},
                                        std::vector<at::Tensor>{}, [](const std::vector<at::Tensor>& x) {
                                          return std::vector<at::Tensor>{MlaLayer::assemble_key(x[0], x[1])};
                                        });
  }
  const at::Tensor& key = key_stage->output(0);  // [B,S_l,H,Dqk]
  AsyncHandle k_exchange = launch(key, Transfer::k);  // K flies under Q
  query_stage = mlacp::query_stage(ctx, step);  // [B,S_l,H,Dqk]
  AsyncHandle q_exchange = launch(query_stage->output(0), Transfer::q);
  if (gate_) gate_stage = mlacp::gate_stage(ctx, step);  // Q flies under the gate projection [B,S_l,H*Dv]
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = {q_exchange.wait_one(), k_exchange.wait_one(), v_exchange.wait_one()};  // [B,U*S_l,Hc,*]
    if (gate_) outputs.push_back(gate_stage->output(0).detach());
  }

  // --- the node: inputs kv_latent, kv_b_proj, key_rope, query_latent, query params[, hidden, gate params] ---
  // (each stage's external inputs; build_k's key_nope is internal)
  std::vector<at::Tensor> inputs = kv_stage->inputs();
  inputs.push_back(step.key_rope);
  append(inputs, query_stage->inputs());
  if (gate_) append(inputs, gate_stage->inputs());
  const bool needs_q = query_stage->requires_grad(), needs_k = key_stage->requires_grad();
  const bool needs_v = value.requires_grad();
  const size_t kv_inputs = kv_stage->inputs().size(), query_inputs = query_stage->inputs().size();
  BackwardFn backward = [=](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    // g: d Q heads, d K heads, d V heads[, d gate]
    AsyncHandle d_q, d_k, d_v;  // 1. launch dQ, dK, dV (Q first)
    if (needs_q) d_q = launch_head_to_seq(ulysses, g[0], transfer_name(Transfer::dq));
    if (needs_k) d_k = launch_head_to_seq(ulysses, g[1], transfer_name(Transfer::dk));
    if (needs_v) d_v = launch_head_to_seq(ulysses, g[2], transfer_name(Transfer::dv));
    for (size_t i = 0; i < 3; ++i) g[i] = at::Tensor();  // the launched exchanges hold their own buffers
    std::vector<at::Tensor> gate_grads;  // 2. gate_proj backward, under dQ
    if (gate_stage) {
      ComputeSpan span(tl, "gate_proj_backward");
      gate_grads = gate_stage->backprop({g[3]});
    }
    std::vector<at::Tensor> query_grads(query_inputs);  // 3. wait dQ, q_b_proj+RoPE backward under dK, dV
    if (needs_q) {
      at::Tensor dq = d_q.wait_one();
      ComputeSpan span(tl, "q_b_proj_rope_backward");
      query_grads = query_stage->backprop({dq});
    }
    std::vector<at::Tensor> key_grads(2);  // 4. wait dK, build K backward under dV
    if (needs_k) {
      at::Tensor dk = d_k.wait_one();
      ComputeSpan span(tl, "build_k_backward");
      key_grads = key_stage->backprop({dk});
    }
    std::vector<at::Tensor> kv_grads(kv_inputs);  // 5. wait dV, kv_b_proj backward
    if (needs_v || key_grads[0].defined()) kv_grads = kv_stage->backprop({key_grads[0], needs_v ? d_v.wait_one() : at::Tensor()});
    std::vector<at::Tensor> out = kv_grads;
    out.push_back(key_grads[1]);
    append(out, query_grads);
    append(out, gate_grads);
    return out;
  };
  outputs = attach_backward(inputs, outputs, "ExpandedUlyssesSchedule", std::move(backward));
  // The local Q, K, V have been sent: only the exchanged ones (saved by the attention) stay.
  for (Stage* s : {kv_stage.get(), key_stage.get(), query_stage.get()}) s->release_outputs();
  const at::Tensor attention = attend_heads(ctx, step, outputs[0], outputs[1], outputs[2]);
  return output_stage(ctx, step, attention, gate_ ? outputs[3] : at::Tensor(), /*overlap=*/true);
}

}  // namespace

std::unique_ptr<CpSchedule> make_expanded_ulysses_schedule(bool overlap, bool gate) {
  return std::make_unique<ExpandedUlyssesSchedule>(overlap, gate);
}

}  // namespace mlacp
