#include "runtime/overlap_schedule.h"

#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/format.h"
#include "core/timeline.h"
#include "kernels/segmented_attention.h"
#include "mlacp/errors.h"
#include "runtime/collective_ops.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "overlap schedule";

// One exchange launched in one step and waited in a later one. The forward handle is waited in
// forward; the backward handle is launched by one backward node and waited by a later one.
struct ExchangeSlot {
  explicit ExchangeSlot(std::string name_) : name(std::move(name_)) {}
  std::string name;
  AsyncHandle forward;
  AsyncHandle backward;
  bool needs_grad = false;  // whether the sent tensor needs a gradient (frozen: no backward launch)

  at::Tensor wait_backward(const std::string& step) {
    MLACP_REQUIRE(backward.valid(), kWhat, "a backward step found no launched exchange to wait for",
                  {got("exchange", name), got("step", step)},
                  "this is a schedule bug: every waited exchange must be launched by an earlier backward step");
    return backward.wait_one();
  }
  at::Tensor wait_forward(const std::string& step) {
    MLACP_REQUIRE(forward.valid(), kWhat, "a forward step found no launched exchange to wait for",
                  {got("exchange", name), got("step", step)}, "launch before waiting");
    return forward.wait_one();
  }
};
using Slot = std::shared_ptr<ExchangeSlot>;

// Autocast state of the forward, re-entered by backward nodes that run GEMMs themselves.
struct AutocastState {
  bool enabled = compat::autocast_enabled(c10::DeviceType::CPU);
  c10::ScalarType dtype = compat::autocast_dtype(c10::DeviceType::CPU);
  std::unique_ptr<compat::AutocastGuard> enter() const {
    return enabled ? std::make_unique<compat::AutocastGuard>(c10::DeviceType::CPU, true, dtype) : nullptr;
  }
};

Timeline* timeline_of(const ScheduleContext& ctx) { return ctx.groups.timeline.get(); }

// Launches seq->head of `send` now and returns `carrier` unchanged, tied to a node whose
// backward waits the inverse exchange (launched by a later node of the forward, i.e. an earlier
// one of the backward) and returns it as `send`'s gradient. The carrier's data dependency is
// what places this wait after the backward work that consumes the carrier.
at::Tensor launch_and_carry(const CommGroup& group, const at::Tensor& send, const at::Tensor& carrier,
                            const Slot& slot) {
  slot->needs_grad = send.requires_grad() && at::GradMode::is_enabled();
  {
    at::NoGradGuard no_grad;
    slot->forward = launch_seq_to_head(group, send.detach(), slot->name);
  }
  return attach_backward({send, carrier}, {carrier}, "LaunchAndCarry[" + slot->name + "]",
                         [slot](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
                           at::Tensor send_grad;
                           if (slot->needs_grad) send_grad = slot->wait_backward("LaunchAndCarry");
                           return {send_grad, grads[0]};
                         })[0];
}

// Launches head->seq of each gradient whose exchange needs one (in the given order).
void launch_inverse(const CommGroup& group, const std::vector<std::pair<Slot, at::Tensor>>& items) {
  for (const auto& [slot, grad] : items)
    if (slot->needs_grad) slot->backward = launch_head_to_seq(group, grad, "d" + slot->name);
}

}  // namespace

ScheduledInputs overlapped_expanded_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                           const at::Tensor& hidden, const at::Tensor& rope_positions,
                                           const at::Tensor& key_rope) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup& group = ctx.groups.ulysses;
  Timeline* tl = timeline_of(ctx);
  auto q = std::make_shared<ExchangeSlot>("q"), k = std::make_shared<ExchangeSlot>("k"),
       v = std::make_shared<ExchangeSlot>("v");
  at::Tensor key, value, query, gate, key_nope, x = hidden;
  const int64_t heads = m.local_heads();
  {
    ComputeSpan span(tl, "kv_b_proj");
    auto [weight, bias] = m.kv_up_rows(0, heads);
    at::Tensor kv = at::linear(latents.kv_latent, weight, bias);
    kv = kv.view({kv.size(0), kv.size(1), heads, c.qk_nope_head_dim + c.v_head_dim});  // [B,S_l,H,Dn+Dv]
    std::vector<at::Tensor> parts = kv.split_with_sizes({c.qk_nope_head_dim, c.v_head_dim}, -1);
    key_nope = parts[0];
    value = parts[1];
  }
  key_nope = launch_and_carry(group, value, key_nope, v);  // V flies while K is built
  {
    ComputeSpan span(tl, "build_k");
    at::Tensor shared = key_rope.unsqueeze(2).expand({key_nope.size(0), key_nope.size(1), heads, c.qk_rope_head_dim});
    key = at::cat({key_nope, shared.to(key_nope.scalar_type())}, -1);  // [B,S_l,H,Dqk]
  }
  at::Tensor query_latent = launch_and_carry(group, key, latents.query_latent, k);  // K flies under Q
  {
    ComputeSpan span(tl, "q_b_proj_rope");
    query = m.expand_query(query_latent, rope_positions);  // [B,S_l,H,Dqk]
  }
  std::vector<at::Tensor> wait_inputs{query, key, value};
  if (c.output_gate) {
    x = launch_and_carry(group, query, hidden, q);  // Q flies under the gate projection
    ComputeSpan span(tl, "gate_proj");
    gate = at::sigmoid(m.o_gate_proj(x));  // [B,S_l,H*Dv]
    wait_inputs.push_back(gate);
  } else {
    q->needs_grad = query.requires_grad() && at::GradMode::is_enabled();
    at::NoGradGuard no_grad;
    q->forward = launch_seq_to_head(group, query.detach(), "q");
  }
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = {q->wait_forward("wait_qkv"), k->wait_forward("wait_qkv"), v->wait_forward("wait_qkv")};
    if (c.output_gate) outputs.push_back(gate.detach());
  }
  const bool has_gate = c.output_gate;
  outputs = attach_backward(wait_inputs, outputs, "WaitQKV", [group, q, k, v, has_gate](std::vector<at::Tensor> g) {
    launch_inverse(group, {{q, g[0]}, {k, g[1]}, {v, g[2]}});  // Q first
    if (has_gate) return std::vector<at::Tensor>{{}, {}, {}, g[3]};  // gate bwd overlaps dQ
    at::Tensor dq;
    if (q->needs_grad) dq = q->wait_backward("WaitQKV");  // q_b_proj/RoPE bwd overlaps dK, dV
    return std::vector<at::Tensor>{dq, {}, {}};
  });
  return {outputs[0], outputs[1], outputs[2], has_gate ? outputs[3] : at::Tensor()};
}

ScheduledInputs overlapped_expanded_hybrid_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                                  const at::Tensor& rope_positions, const at::Tensor& key_rope) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup& ulysses = ctx.groups.ulysses;
  const CommGroup& gather_group = ctx.groups.all_gather;
  Timeline* tl = timeline_of(ctx);
  at::Tensor key, value, query;
  {
    ComputeSpan span(tl, "kv_b_proj");
    std::tie(key, value) = m.expand_key_value(latents.kv_latent, key_rope, 0, m.local_heads());
  }
  at::Tensor kv = at::cat({key, value}, -1);  // [B,S_l,H,Dqk+Dv]
  AsyncHandle kv_exchange, q_exchange, kv_gather;
  {
    at::NoGradGuard no_grad;
    kv_exchange = launch_seq_to_head(ulysses, kv.detach(), "kv");
  }
  {
    ComputeSpan span(tl, "q_b_proj_rope");
    query = m.expand_query(latents.query_latent, rope_positions);
  }
  at::Tensor kv_heads, kv_all, q_heads;
  {
    at::NoGradGuard no_grad;
    q_exchange = launch_seq_to_head(ulysses, query.detach(), "q");
    kv_heads = kv_exchange.wait_one();
    kv_gather = launch_all_gather_seq(gather_group, kv_heads, "kv_gather");
    q_heads = q_exchange.wait_one();
    kv_all = kv_gather.wait_one();
  }
  // Backward: the plain inverse of each step, waited at once.
  q_heads = attach_backward({query}, {q_heads}, "QExchange", [ulysses](std::vector<at::Tensor> g) {
    return launch_head_to_seq(ulysses, g[0], "dq").wait();
  })[0];
  kv_all = attach_backward({kv}, {kv_all}, "KVExchangeGather", [ulysses, gather_group](std::vector<at::Tensor> g) {
    at::Tensor local = launch_reduce_scatter_seq(gather_group, g[0], "dkv_gather").wait_one();
    return launch_head_to_seq(ulysses, local, "dkv").wait();
  })[0];
  std::vector<at::Tensor> parts = kv_all.split_with_sizes({c.qk_head_dim(), c.v_head_dim}, -1);
  return {q_heads, parts[0], parts[1], {}};
}

std::unique_ptr<SegmentedAttention> own_rows_attention(const ScheduleContext& ctx, const at::Tensor& query_local,
                                                       const at::Tensor& key, const at::Tensor& value) {
  if (!ctx.structure || ctx.plan.kernel() != AttentionKernel::blockwise) return nullptr;
  const int64_t local_len = query_local.size(1), rows = ctx.groups.ulysses.size() * local_len;
  const int64_t u = ctx.plan.ulysses_rank(ctx.groups.cp_rank), heads = ctx.plan.compute_heads();
  auto attention = std::make_unique<SegmentedAttention>(key.transpose(1, 2), value.transpose(1, 2),
                                                        ctx.module.scaling(), *ctx.structure, rows);
  ComputeSpan span(timeline_of(ctx), "attention_own_rows");
  attention->compute_rows(query_local.narrow(2, u * heads, heads).transpose(1, 2), u * local_len);
  return attention;
}

ScheduledInputs overlapped_latent_inputs(const ScheduleContext& ctx, const LocalLatents& latents,
                                         const at::Tensor& rope_positions, const at::Tensor& key_rope) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup& ulysses = ctx.groups.ulysses;
  const CommGroup& cp = ctx.groups.cp;
  Timeline* tl = timeline_of(ctx);
  at::Tensor payload = at::cat({latents.kv_latent, key_rope.to(latents.kv_latent.scalar_type())}, -1);  // [B,S_l,Rkv+Dr]
  AsyncHandle gather;
  {
    at::NoGradGuard no_grad;
    gather = launch_all_gather_seq(cp, payload.detach(), "latent");
  }
  at::Tensor query;
  {
    ComputeSpan span(tl, "q_b_proj_rope");
    query = m.expand_query(latents.query_latent, rope_positions);  // [B,S_l,H,Dqk]
  }
  at::Tensor gathered;  // [B,S,Rkv+Dr], no grad: its gradient is KVLatent's reduce-scatter
  {
    at::NoGradGuard no_grad;
    gathered = gather.wait_one();
  }
  auto q = std::make_shared<ExchangeSlot>("q");
  at::Tensor payload_carrier = launch_and_carry(ulysses, query, payload, q);  // Q flies under kv_b_proj
  const int64_t begin = ctx.plan.head_begin(ctx.groups.cp_rank);
  auto [weight, bias] = m.kv_up_rows(begin, begin + ctx.plan.compute_heads());
  const int64_t rkv = c.kv_lora_rank;
  at::Tensor latent_all = gathered.narrow(-1, 0, rkv), shared_all = gathered.narrow(-1, rkv, c.qk_rope_head_dim);
  at::Tensor projected;
  {
    ComputeSpan span(tl, "kv_b_proj");
    at::NoGradGuard no_grad;
    projected = at::linear(latent_all, weight.detach(), bias.defined() ? bias.detach() : at::Tensor());
  }
  const AutocastState autocast;
  std::vector<at::Tensor> inputs{payload_carrier, weight};
  if (bias.defined()) inputs.push_back(bias);
  // The carrier may require grad only because the query does: the payload's own need decides.
  const bool needs_payload = payload.requires_grad(), needs_weight = weight.requires_grad();
  const bool needs_bias = bias.defined() && bias.requires_grad();
  const bool has_bias = bias.defined();
  at::Tensor latent_saved = latent_all.contiguous(), weight_saved = weight.detach();
  std::vector<at::Tensor> kv = attach_backward(
      inputs, {projected, shared_all.clone()}, "KVLatent",
      [cp, tl, autocast, latent_saved, weight_saved, needs_payload, needs_weight, needs_bias,
       has_bias](std::vector<at::Tensor> g) {
        auto guard = autocast.enter();
        const at::Tensor d_kv = g[0].reshape({-1, g[0].size(-1)});  // [B*S, h*(Dn+Dv)]
        AsyncHandle reduce;
        if (needs_payload) {
          ComputeSpan span(tl, "kv_b_proj_dgrad");
          at::Tensor d_latent = d_kv.mm(weight_saved).view({g[0].size(0), g[0].size(1), -1});
          at::Tensor d_payload = at::cat({d_latent.to(g[1].scalar_type()), g[1]}, -1);
          reduce = launch_reduce_scatter_seq(cp, d_payload, "dlatent");  // before the wgrad GEMM
        }
        at::Tensor d_weight, d_bias;
        if (needs_weight) {
          ComputeSpan span(tl, "kv_b_proj_wgrad");
          // [out, Rkv] = d_kv^T latent: contiguous like the weight (a transposed result would be
          // copied again when accumulated).
          d_weight = d_kv.t().mm(latent_saved.reshape({-1, latent_saved.size(-1)})).to(weight_saved.scalar_type());
        }
        if (needs_bias) d_bias = d_kv.sum(0).to(weight_saved.scalar_type());
        at::Tensor d_local;
        if (needs_payload) d_local = reduce.wait_one();  // after the wgrad GEMM
        std::vector<at::Tensor> out{d_local, d_weight};
        if (has_bias) out.push_back(d_bias);
        return out;
      });
  auto [key, value] = m.assemble_key_value(kv[0], kv[1]);  // [B,S,Hc,*]
  // This rank's own query rows are here already: their attention runs while the others fly.
  std::unique_ptr<SegmentedAttention> attention = own_rows_attention(ctx, query, key, value);
  std::vector<at::Tensor> waited;
  {
    at::NoGradGuard no_grad;
    waited = {q->wait_forward("wait_q")};
  }
  // Q's wait node: query is an input only so that the waited Q requires grad; its gradient
  // travels through LaunchAndCarry, which waits the inverse launched here.
  waited = attach_backward({query, key, value}, {waited[0], key.detach(), value.detach()}, "WaitQ",
                           [ulysses, q](std::vector<at::Tensor> g) {
                             launch_inverse(ulysses, {{q, g[0]}});  // dQ first: overlaps KV backward
                             return std::vector<at::Tensor>{{}, g[1], g[2]};
                           });
  if (!attention) return {waited[0], waited[1], waited[2], {}};
  ComputeSpan span(tl, "attention");
  return {waited[0], waited[1], waited[2], {}, finish_rows_attention(*attention, waited[0], waited[1], waited[2])};
}


struct OutputExchange {
  ExchangeSlot d_out{"o"};
  at::Tensor returned_grad;  // what OutputLinear handed to the restore node
};

RestoredOutput overlapped_restore(const ScheduleContext& ctx, const at::Tensor& attention) {
  const MlaConfig& c = ctx.module.config();
  const CommGroup& ulysses = ctx.groups.ulysses;
  const int64_t batch = attention.size(0), local_len = attention.size(1) / ulysses.size();
  const int64_t width = ctx.plan.local_heads() * c.v_head_dim;
  at::Tensor restored_data;
  {
    at::NoGradGuard no_grad;
    restored_data = launch_head_to_seq(ulysses, attention.detach(), "o").wait_one();  // [B,S_l,H,Dv]
    const std::vector<int64_t> expected{batch, local_len, ctx.plan.local_heads(), c.v_head_dim};
    MLACP_REQUIRE(restored_data.sizes().vec() == expected, kWhat, "output shape mismatch after the head->seq restore",
                  {got("shape", shape_text(restored_data)), got("expected", shape_text(expected))},
                  "this is an internal error: report it with the plan");
    restored_data = restored_data.reshape({batch, local_len, width});
  }
  auto state = std::make_shared<OutputExchange>();
  const std::vector<int64_t> attention_shape = attention.sizes().vec();
  at::Tensor restored = attach_backward({attention}, {restored_data}, "RestoreOutput",
                                        [state, attention_shape](std::vector<at::Tensor> g) {
    MLACP_REQUIRE(state->returned_grad.defined() && g[0].is_same(state->returned_grad), kWhat,
                  "o_proj must be the only consumer of the restored attention output",
                  {got("restored_output_consumers", "more than o_proj")},
                  "use the module's output (after o_proj), not the intermediate restored attention");
    state->returned_grad = at::Tensor();
    return std::vector<at::Tensor>{state->d_out.wait_backward("RestoreOutput").view(attention_shape)};
  })[0];
  return {restored, state};
}

at::Tensor overlapped_projection(const ScheduleContext& ctx, const RestoredOutput& restored_output,
                                 const at::Tensor& hidden, const at::Tensor& gate_in) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup& ulysses = ctx.groups.ulysses;
  Timeline* tl = timeline_of(ctx);
  const at::Tensor& restored = restored_output.restored;
  const std::shared_ptr<OutputExchange>& state = restored_output.exchange;

  at::Tensor gate = gate_in;
  if (c.output_gate && !gate.defined()) {
    ComputeSpan span(tl, "gate_proj");
    gate = at::sigmoid(m.o_gate_proj(hidden));
  }
  const bool tp = ctx.plan.tp() > 1;
  at::Tensor weight = m.o_proj->weight, bias = tp ? at::Tensor() : m.o_proj->bias;
  std::vector<at::Tensor> inputs{restored, weight};
  if (gate.defined()) inputs.push_back(gate);
  if (bias.defined()) inputs.push_back(bias);
  at::Tensor projected, y;
  {
    ComputeSpan span(tl, "o_proj");
    at::NoGradGuard no_grad;
    projected = gate.defined() ? restored.detach() * gate.detach() : restored.detach();
    y = at::linear(projected, weight.detach(), bias.defined() ? bias.detach() : at::Tensor());
  }
  const AutocastState autocast;
  const bool needs_act = restored.requires_grad(), needs_weight = weight.requires_grad();
  const bool needs_gate = gate.defined() && gate.requires_grad(), needs_bias = bias.defined() && bias.requires_grad();
  const bool has_gate = gate.defined(), has_bias = bias.defined();
  at::Tensor restored_saved = restored.detach(), gate_saved = gate.defined() ? gate.detach() : at::Tensor();
  at::Tensor weight_saved = weight.detach();
  const int64_t heads = ctx.plan.local_heads(), dv = c.v_head_dim;
  y = attach_backward(inputs, {y}, "OutputLinear",
                      [state, ulysses, tl, autocast, projected, restored_saved, gate_saved, weight_saved, needs_act,
                       needs_weight, needs_gate, needs_bias, has_gate, has_bias, heads, dv](std::vector<at::Tensor> g) {
    auto guard = autocast.enter();
    const at::Tensor d_y = g[0].reshape({-1, g[0].size(-1)});  // [B*S_l, d]
    at::Tensor d_projected, d_act, d_weight, d_gate, d_bias;
    if (needs_act || needs_gate) {
      ComputeSpan span(tl, "o_proj_dgrad");
      d_projected = d_y.mm(weight_saved).view(restored_saved.sizes());
    }
    if (needs_act) {
      d_act = (has_gate ? d_projected * gate_saved : d_projected).to(restored_saved.scalar_type());
      const auto& s = restored_saved.sizes();
      state->d_out.backward = launch_seq_to_head(ulysses, d_act.view({s[0], s[1], heads, dv}), "dO");
      state->returned_grad = d_act;
    }
    if (needs_gate) d_gate = d_projected * restored_saved;  // overlaps dO
    if (needs_weight) {
      ComputeSpan span(tl, "o_proj_wgrad");  // overlaps dO
      d_weight = d_y.t().mm(projected.reshape({-1, projected.size(-1)})).to(weight_saved.scalar_type());
    }
    if (needs_bias) d_bias = d_y.sum(0).to(weight_saved.scalar_type());
    std::vector<at::Tensor> out{d_act, d_weight};
    if (has_gate) out.push_back(d_gate);
    if (has_bias) out.push_back(d_bias);
    return out;
  })[0];
  if (!tp) return y;
  y = all_reduce_sum(ctx.groups.tp, y, "o_proj");
  return m.o_proj->bias.defined() ? y + m.o_proj->bias : y;
}

}  // namespace mlacp
