// The latent strategy (docs/DESIGN.md §4, §5): every CP rank all-gathers the 576-wide latent
// [kv_latent | k_rope] instead of expanded K/V, and expands K/V itself for its head block only.
// Queries take the Ulysses seq->head exchange (U > 1) like the expanded strategy's.
//
// Plain form (each collective waited at once; autograd runs each step's adjoint in reverse):
//   q_b_proj+RoPE | Q seq->head | latent all-gather | kv_b_proj (head block) | attention | output
//
// Overlapped form: one node from the latents to (Q heads, K, V):
//   forward:   launch latent gather | q_b_proj+RoPE | wait gather | launch Q | kv_b_proj (head block) |
//              [blockwise: attention of this rank's own query rows] | wait Q | [the other rows] | output
//   backward:  (attention backward) | launch dQ | K,V assembly backward | kv_b_proj dgrad |
//              launch dlatent reduce-scatter | kv_b_proj wgrad | wait reduce-scatter | wait dQ |
//              q_b_proj+RoPE backward
//
// Both forms split the attention's query rows the same way (this rank's own rows first: they are
// local before the Q exchange completes), so their results are identical to the bit.
//
// With kv_recompute (runtime/latent_kv_attention.h) kv_b_proj and the attention are one step that
// expands K/V a few heads at a time and again in the backward; the overlapped form's node then
// runs from the latents to the attention output:
//   forward:   launch latent gather | q_b_proj+RoPE | wait gather | launch Q |
//              [per sub-block: kv_b_proj, attention of own rows] | wait Q | [per sub-block: the others]
//   backward:  per sub-block: kv_b_proj, attention backward, kv_b_proj dgrad (and wgrad but the
//              last) | launch dQ, launch dlatent reduce-scatter | last wgrad | wait dQ |
//              q_b_proj+RoPE backward | wait reduce-scatter
#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/stage.h"
#include "core/timeline.h"
#include "kernels/attend.h"
#include "kernels/segmented_attention.h"
#include "model/mla_layer.h"
#include "runtime/collective_ops.h"
#include "runtime/latent_kv_attention.h"
#include "runtime/output_stage.h"
#include "runtime/schedule.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "latent schedule";

// [kv_latent | k_rope] [B,S_l,Rkv+Dr]: what the latent strategy moves.
at::Tensor latent_payload(const at::Tensor& kv_latent, const at::Tensor& key_rope) {
  return at::cat({kv_latent, key_rope.to(kv_latent.scalar_type())}, -1);
}

// The attention over (Ulysses block rows x all keys), rows split as both forms split them: this
// rank's own rows (its head block of the local query [B,S_l,H,Dqk]) computed by start(), the
// others by finish(). The reference kernel computes all rows in finish().
class RowSplitAttention {
 public:
  RowSplitAttention(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& key, const at::Tensor& value)
      : ctx_(ctx), step_(step), key_(key), value_(value) {}
  void start(const at::Tensor& query_local) {
    // Row segments are the CPU blockwise kernel's; on a GPU the stream overlaps the exchange instead.
    // device: row segments are the CPU blockwise kernel's
    if (ctx_.plan.kernel() != AttentionKernel::blockwise || !key_.device().is_cpu()) return;
    const int64_t local_len = query_local.size(1), rows = ctx_.groups.ulysses.size() * local_len;
    const int64_t u = ctx_.plan.ulysses_rank(ctx_.groups.cp_rank), heads = ctx_.plan.head_block_size();
    segmented_ = std::make_unique<SegmentedAttention>(key_.transpose(1, 2), value_.transpose(1, 2),
                                                      ctx_.module.scaling(), step_.structure, rows);
    ComputeSpan span(ctx_.groups.instruments.timeline.get(), "attention_own_rows");
    segmented_->compute_rows(query_local.narrow(2, u * heads, heads).transpose(1, 2), u * local_len);
  }
  // q_heads [B,U*S_l,Hc,Dqk] and the K, V given to the constructor (with autograd history)
  // -> [B,U*S_l,Hc,Dv].
  at::Tensor finish(const at::Tensor& q_heads, const at::Tensor& key, const at::Tensor& value) {
    ComputeSpan span(ctx_.groups.instruments.timeline.get(), "attention");
    at::Tensor out = segmented_ ? segmented_->finish(q_heads.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
                                : attend(ctx_.plan.kernel(), q_heads.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), ctx_.module.scaling(), step_.structure);
    return out.transpose(1, 2);  // [B,Sq,Hc,Dv]
  }

 private:
  const ScheduleContext& ctx_;
  const LocalStep& step_;
  at::Tensor key_, value_;
  std::unique_ptr<SegmentedAttention> segmented_;
};

// What the latent strategy sends, [kv_latent | key rope] [B,S_l,Rkv+Dr], as the overlapped forms'
// nodes take it: its inputs are edges to the two tensors (nothing of them is kept: a stage would
// hold the latent, as its graph's leaf, until the backward), and its backward is the concat's.
struct LatentPayload {
  at::Tensor kv_latent, key_rope;  // with their autograd history (the node's inputs)
  bool requires_grad() const { return kv_latent.requires_grad() || key_rope.requires_grad(); }
  std::vector<at::Tensor> inputs() const { return {kv_latent, key_rope}; }
  // What the node's backward needs of it (no tensor: see above).
  struct Backward {
    int64_t latent_width;
    at::ScalarType key_rope_dtype;
    bool latent_grad, key_rope_grad;
    // d payload [B,S_l,Rkv+Dr] -> d kv_latent, d key rope (the concat's backward: views of d, the
    // key rope's part in its dtype; undefined where not needed).
    std::vector<at::Tensor> operator()(const at::Tensor& d) const {
      at::Tensor d_latent, d_key_rope;
      if (latent_grad) d_latent = d.narrow(-1, 0, latent_width);
      if (key_rope_grad) d_key_rope = d.narrow(-1, latent_width, d.size(-1) - latent_width).to(key_rope_dtype);
      return {d_latent, d_key_rope};
    }
  };
  Backward backward() const {
    return {kv_latent.size(-1), key_rope.scalar_type(), kv_latent.requires_grad(), key_rope.requires_grad()};
  }
};

// The overlapped forms' start: launch the latent gather, q_b_proj+RoPE under it, wait it, launch
// the Q exchange. The query stage keeps its graph for the node's backward.
struct LatentExchanges {
  LatentPayload payload;
  std::shared_ptr<Stage> query;  // Q [B,S_l,H,Dqk]
  at::Tensor gathered;           // [B,S,Rkv+Dr]
  AsyncHandle q_exchange;        // -> [B,U*S_l,Hc,Dqk]
};
LatentExchanges launch_latent_exchanges(const ScheduleContext& ctx, const LocalStep& step) {
  LatentExchanges x;
  x.payload = {step.latents.kv_latent, step.key_rope};
  AsyncHandle gather;
  {
    at::NoGradGuard no_grad;
    gather = launch_all_gather_seq(ctx.groups.cp, latent_payload(step.latents.kv_latent, step.key_rope),
                                   transfer_name(Transfer::latent));
  }
  x.query = query_stage(ctx, step);
  at::NoGradGuard no_grad;
  x.gathered = gather.wait_one();
  x.q_exchange = launch_seq_to_head(ctx.groups.ulysses, x.query->output(0).detach(), transfer_name(Transfer::q));
  return x;
}

class LatentSchedule final : public CpSchedule {
 public:
  LatentSchedule(bool overlap, bool ulysses, bool own_rows, bool kv_recompute)
      : overlap_(overlap), ulysses_(ulysses), own_rows_(own_rows), kv_recompute_(kv_recompute) {}
  std::string name() const override {
    return std::string(overlap_ ? "latent_kv_head (overlapped)" : "latent_kv_head (plain)") +
           (kv_recompute_ ? " kv_recompute" : "");
  }
  std::vector<OverlappedTransfer> overlapped_transfers() const override {
    if (!overlap_) return {};
    if (kv_recompute_) {
      const std::vector<std::string> under_dlatent{"kv_b_proj_wgrad", "q_b_proj_rope_backward"};
      if (!ulysses_) return {{Transfer::latent, {"q_b_proj_rope"}}, {Transfer::dlatent, under_dlatent}};
      return {{Transfer::latent, {"q_b_proj_rope"}},
              {Transfer::q, {"kv_b_proj", "attention_own_rows"}},
              {Transfer::dq, {"kv_b_proj_wgrad"}},
              {Transfer::dlatent, under_dlatent},
              {Transfer::d_o, {"o_proj_wgrad"}}};
    }
    if (!ulysses_) return {{Transfer::latent, {"q_b_proj_rope"}}, {Transfer::dlatent, {"kv_b_proj_wgrad"}}};
    return {{Transfer::latent, {"q_b_proj_rope"}},
            {Transfer::q, own_rows_ ? std::vector<std::string>{"kv_b_proj", "attention_own_rows"}
                                    : std::vector<std::string>{"kv_b_proj"}},
            {Transfer::dq, {"kv_b_proj_dgrad", "kv_b_proj_wgrad"}},
            {Transfer::dlatent, {"kv_b_proj_wgrad"}},
            {Transfer::d_o, {"o_proj_wgrad"}}};
  }
  at::Tensor forward(const ScheduleContext& ctx, const LocalStep& step) override {
    if (kv_recompute_) return overlap_ ? overlapped_recompute(ctx, step) : plain_recompute(ctx, step);
    return overlap_ ? overlapped(ctx, step) : plain(ctx, step);
  }

 private:
  at::Tensor plain(const ScheduleContext& ctx, const LocalStep& step);
  at::Tensor overlapped(const ScheduleContext& ctx, const LocalStep& step);
  at::Tensor plain_recompute(const ScheduleContext& ctx, const LocalStep& step);
  at::Tensor overlapped_recompute(const ScheduleContext& ctx, const LocalStep& step);
  bool overlap_, ulysses_;  // ulysses_: U > 1 (queries take the seq->head exchange)
  bool own_rows_;           // blockwise kernel: own query rows attend under the Q exchange
  bool kv_recompute_;       // K/V expanded per sub-block, again in the backward (CPU blockwise kernel)
};

// The K/V-recompute attention of this rank's head block over the gathered latent, its own query
// rows computed from the local query [B,S_l,H,Dqk] now (both forms, so they split rows alike).
std::unique_ptr<LatentKvAttention> start_recompute(const ScheduleContext& ctx, const LocalStep& step,
                                                   const at::Tensor& latent, const at::Tensor& key_rope,
                                                   const at::Tensor& weight, const at::Tensor& bias,
                                                   const at::Tensor& query_local) {
  const int64_t local_len = query_local.size(1), rows = ctx.groups.ulysses.size() * local_len;
  const int64_t u = ctx.plan.ulysses_rank(ctx.groups.cp_rank), heads = ctx.plan.head_block_size();
  auto a = std::make_unique<LatentKvAttention>(ctx.module.config(), ctx.plan.kv_recompute_heads(), latent, key_rope,
                                               weight, bias, ctx.module.scaling(), step.structure, rows,
                                               ctx.groups.instruments.timeline.get());
  a->compute_rows(query_local.detach().narrow(2, u * heads, heads), u * local_len);
  return a;
}

// The plain forms' start: q_b_proj+RoPE, the Q exchange, then the latent gather split into the
// dense latent [B,S,Rkv] and key rope [B,S,Dr]. Dense, as the overlapped forms' operands: the bf16
// GEMMs (oneDNN) choose their kernel, hence their summation order, by the operands' strides, so a
// view of the gathered payload (row stride Rkv+Dr) would round kv_b_proj differently (DESIGN.md
// §5); and no view keeps the gathered payload alive for the backward.
struct PlainExchanges {
  at::Tensor query;     // [B,S_l,H,Dqk]
  at::Tensor q_heads;   // [B,U*S_l,Hc,Dqk]
  at::Tensor latent;    // [B,S,Rkv]
  at::Tensor key_rope;  // [B,S,Dr]
};
PlainExchanges plain_exchanges(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  PlainExchanges x;
  {
    ComputeSpan span(ctx.groups.instruments.timeline.get(), "q_b_proj_rope");
    x.query = MlaLayer::expand_query(m, step.latents.query_latent, step.rope);
  }
  x.q_heads = seq_to_head(ctx.groups.ulysses, {x.query}, Transfer::q)[0];
  const at::Tensor gathered =
      all_gather_seq(ctx.groups.cp, latent_payload(step.latents.kv_latent, step.key_rope), Transfer::latent);
  x.latent = gathered.narrow(-1, 0, c.kv_lora_rank).contiguous();
  x.key_rope = gathered.narrow(-1, c.kv_lora_rank, c.qk_rope_head_dim).contiguous();
  return x;
}

at::Tensor LatentSchedule::plain(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  const PlainExchanges x = plain_exchanges(ctx, step);
  const int64_t begin = ctx.plan.head_begin(ctx.groups.cp_rank);
  at::Tensor key, value;
  {
    ComputeSpan span(ctx.groups.instruments.timeline.get(), "kv_b_proj");
    std::tie(key, value) = MlaLayer::expand_key_value(m, x.latent, x.key_rope, begin,
                                                      begin + ctx.plan.head_block_size());  // [B,S,Hc,*]
  }
  RowSplitAttention attention(ctx, step, key, value);
  attention.start(x.query);
  return output_stage(ctx, step, attention.finish(x.q_heads, key, value), {}, /*overlap=*/false);
}

at::Tensor LatentSchedule::overlapped(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup &ulysses = ctx.groups.ulysses, &cp = ctx.groups.cp;
  Timeline* tl = ctx.groups.instruments.timeline.get();

  // --- forward ---
  LatentExchanges x = launch_latent_exchanges(ctx, step);
  const LatentPayload payload = x.payload;
  const std::shared_ptr<Stage> query_stage = x.query;
  const at::Tensor& query = query_stage->output(0);  // [B,S_l,H,Dqk]
  const at::Tensor gathered = x.gathered;            // [B,S,Rkv+Dr]
  AsyncHandle q_exchange = std::move(x.q_exchange);
  const int64_t begin = ctx.plan.head_begin(ctx.groups.cp_rank);
  auto [weight, bias] = MlaLayer::kv_up_rows(m, begin, begin + ctx.plan.head_block_size());
  // Contiguous like the plain form's kv_b_proj input: same operand layout, same GEMM kernels.
  const at::Tensor latent_all = gathered.narrow(-1, 0, c.kv_lora_rank).contiguous();  // [B,S,Rkv]
  const at::Tensor shared_all = gathered.narrow(-1, c.kv_lora_rank, c.qk_rope_head_dim);  // [B,S,Dr]
  at::Tensor projected;  // [B,S,Hc*(Dn+Dv)]
  {
    ComputeSpan span(tl, "kv_b_proj");
    at::NoGradGuard no_grad;
    projected = at::linear(latent_all, weight.detach(), bias.defined() ? bias.detach() : at::Tensor());
  }
  const bool has_bias = bias.defined(), needs_payload = payload.requires_grad();
  const bool needs_weight = weight.requires_grad(), needs_bias = has_bias && bias.requires_grad();
  auto kv_stage = std::make_shared<Stage>(
      "assemble_kv", std::vector<at::Tensor>{projected, shared_all}, std::vector<at::Tensor>{},
      [&m](const std::vector<at::Tensor>& x) {
        auto [key, value] = MlaLayer::assemble_key_value(m, x[0], x[1]);  // [B,S,Hc,Dqk], [B,S,Hc,Dv]
        return std::vector<at::Tensor>{key, value};
      },
      std::vector<bool>{needs_payload || needs_weight || needs_bias, needs_payload});
  const at::Tensor &key = kv_stage->output(0), &value = kv_stage->output(1);
  RowSplitAttention attention(ctx, step, key, value);
  attention.start(query);  // this rank's own rows, while the other ranks' rows fly
  at::Tensor q_heads;      // [B,U*S_l,Hc,Dqk]
  {
    at::NoGradGuard no_grad;
    q_heads = q_exchange.wait_one();
  }

  // --- the node: inputs kv_latent, key_rope, query_latent, query params, kv_b_proj rows ---
  std::vector<at::Tensor> inputs = payload.inputs();
  append(inputs, query_stage->inputs());
  inputs.push_back(weight);
  if (has_bias) inputs.push_back(bias);
  const LatentPayload::Backward payload_backward = payload.backward();
  const SavedForBackward saved({latent_all, weight.detach()}, {"gathered latent", "kv_b_proj.weight"});
  const compat::AutocastSnapshot autocast = compat::AutocastSnapshot::capture(latent_all.device().type());
  const bool needs_query = query_stage->requires_grad();
  const size_t query_inputs = query_stage->inputs().size();
  const std::vector<int64_t> projected_shape = projected.sizes().vec(), shared_shape = shared_all.sizes().vec();
  BackwardFn backward = [=](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    // g: d q_heads, d key, d value
    AsyncHandle d_query;
    if (needs_query) d_query = launch_head_to_seq(ulysses, g[0], transfer_name(Transfer::dq));  // 1. launch dQ
    std::vector<at::Tensor> kv_grads = kv_stage->backprop({g[1], g[2]});  // 2. K,V assembly backward
    g.clear();  // each gradient is freed at its last use (the launched dQ holds its own buffer)
    saved.check(kWhat);
    const auto autocast_guard = autocast.enter();
    const at::Tensor &latent_s = saved[0], &weight_s = saved[1];
    at::Tensor d_kv = kv_grads[0].defined() ? kv_grads[0] : at::zeros(projected_shape, latent_s.options());
    d_kv = d_kv.reshape({-1, d_kv.size(-1)});  // [B*S, Hc*(Dn+Dv)]
    kv_grads[0] = at::Tensor();
    AsyncHandle reduce;
    if (needs_payload) {  // 3. kv_b_proj dgrad, launch the reduce-scatter before the wgrad GEMM
      ComputeSpan span(tl, "kv_b_proj_dgrad");
      at::Tensor d_latent = d_kv.mm(weight_s).view({latent_s.size(0), latent_s.size(1), -1});
      const at::Tensor d_shared = kv_grads[1].defined() ? kv_grads[1] : at::zeros(shared_shape, latent_s.options());
      reduce = launch_reduce_scatter_seq(cp, at::cat({d_latent.to(d_shared.scalar_type()), d_shared}, -1),
                                         transfer_name(Transfer::dlatent));
      kv_grads[1] = at::Tensor();
    }
    at::Tensor d_weight, d_bias;
    if (needs_weight) {  // 4. kv_b_proj wgrad ([out, Rkv], like the weight)
      ComputeSpan span(tl, "kv_b_proj_wgrad");
      d_weight = d_kv.t().mm(latent_s.reshape({-1, latent_s.size(-1)})).to(weight_s.scalar_type());
    }
    if (needs_bias) d_bias = d_kv.sum(0).to(weight_s.scalar_type());
    d_kv = at::Tensor();
    std::vector<at::Tensor> payload_grads(2);  // 5. wait the reduce-scatter: this rank's d payload
    if (needs_payload) payload_grads = payload_backward(reduce.wait_one());
    std::vector<at::Tensor> query_grads(query_inputs);  // 6. wait dQ, then q_b_proj+RoPE backward
    if (needs_query) query_grads = query_stage->backprop({d_query.wait_one()});
    std::vector<at::Tensor> out = payload_grads;
    append(out, query_grads);
    out.push_back(d_weight);
    if (has_bias) out.push_back(d_bias);
    return out;
  };
  std::vector<at::Tensor> waited = attach_backward(inputs, {q_heads, key.detach(), value.detach()}, "LatentSchedule",
                                                   std::move(backward));
  // Sent or handed on: the local payload and Q (their exchanged forms are what the rest reads),
  // K and V (the attention holds them).
  for (Stage* s : {query_stage.get(), kv_stage.get()}) s->release_outputs();
  return output_stage(ctx, step, attention.finish(waited[0], waited[1], waited[2]), {}, /*overlap=*/true);
}

at::Tensor LatentSchedule::plain_recompute(const ScheduleContext& ctx, const LocalStep& step) {
  const PlainExchanges x = plain_exchanges(ctx, step);
  const int64_t begin = ctx.plan.head_begin(ctx.groups.cp_rank);
  auto [weight, bias] = MlaLayer::kv_up_rows(ctx.module, begin, begin + ctx.plan.head_block_size());
  auto attention = start_recompute(ctx, step, x.latent, x.key_rope, weight, bias, x.query);
  const at::Tensor out = attention->finish(x.q_heads, x.latent, x.key_rope, weight, bias);  // [B,U*S_l,Hc,Dv]
  return output_stage(ctx, step, out, {}, /*overlap=*/false);
}

at::Tensor LatentSchedule::overlapped_recompute(const ScheduleContext& ctx, const LocalStep& step) {
  MlaAttentionImpl& m = ctx.module;
  const MlaConfig& c = m.config();
  const CommGroup &ulysses = ctx.groups.ulysses, &cp = ctx.groups.cp;
  Timeline* tl = ctx.groups.instruments.timeline.get();

  // --- forward ---
  LatentExchanges x = launch_latent_exchanges(ctx, step);
  const LatentPayload payload = x.payload;
  const std::shared_ptr<Stage> query_stage = x.query;
  at::Tensor gathered = std::move(x.gathered);  // [B,S,Rkv+Dr]
  AsyncHandle q_exchange = std::move(x.q_exchange);
  const int64_t begin = ctx.plan.head_begin(ctx.groups.cp_rank);
  auto [weight, bias] = MlaLayer::kv_up_rows(m, begin, begin + ctx.plan.head_block_size());
  const at::Tensor latent = gathered.narrow(-1, 0, c.kv_lora_rank).contiguous();  // [B,S,Rkv]
  const at::Tensor key_rope = gathered.narrow(-1, c.kv_lora_rank, c.qk_rope_head_dim).contiguous();  // [B,S,Dr]
  gathered = at::Tensor();  // both parts are dense copies: the payload is not kept
  // This rank's own rows while the other ranks' rows fly.
  std::shared_ptr<LatentKvAttention> attention =
      start_recompute(ctx, step, latent, key_rope, weight.detach(), bias.defined() ? bias.detach() : at::Tensor(),
                      query_stage->output(0));
  at::Tensor q_heads;  // [B,U*S_l,Hc,Dqk]
  {
    at::NoGradGuard no_grad;
    q_heads = q_exchange.wait_one();
  }
  at::Tensor out = attention->finish_rows(q_heads);  // [B,U*S_l,Hc,Dv]

  // --- the node: inputs kv_latent, key_rope, query_latent, query params, kv_b_proj rows ---
  const bool has_bias = bias.defined(), needs_payload = payload.requires_grad(), needs_query = query_stage->requires_grad();
  const LatentKvAttention::Needs needs{needs_query, needs_payload,
                                       weight.requires_grad() || (has_bias && bias.requires_grad())};
  std::vector<at::Tensor> inputs = payload.inputs();
  append(inputs, query_stage->inputs());
  inputs.push_back(weight);
  if (has_bias) inputs.push_back(bias);
  const size_t query_inputs = query_stage->inputs().size();
  const LatentPayload::Backward payload_backward = payload.backward();
  BackwardFn backward = [=](std::vector<at::Tensor> g) -> std::vector<at::Tensor> {
    attention->check_saved();
    AsyncHandle d_query, reduce;
    // Per sub-block backward; once dQ and the latent's gradient are complete, launch both
    // exchanges under the last sub-block's wgrad (the attention's own state is freed by then).
    at::Tensor d_out = std::move(g[0]);
    g.clear();
    auto launch = [&](LatentKvAttention::Grads& x) {
      if (needs_query) d_query = launch_head_to_seq(ulysses, x.dq, transfer_name(Transfer::dq));
      if (needs_payload) {
        at::Tensor d_payload = at::cat({x.d_latent, x.d_key_rope.to(x.d_latent.scalar_type())}, -1);
        x.d_latent = x.d_key_rope = at::Tensor();
        reduce = launch_reduce_scatter_seq(cp, d_payload, transfer_name(Transfer::dlatent));
      }
      x.dq = at::Tensor();  // the launched exchanges hold their own buffers
    };
    LatentKvAttention::Grads grads = attention->backward(std::move(d_out), needs, launch, /*last_use=*/true);
    std::vector<at::Tensor> query_grads(query_inputs);  // wait dQ, q_b_proj+RoPE backward (under the reduce-scatter)
    if (needs_query) {
      at::Tensor dq = d_query.wait_one();
      ComputeSpan span(tl, "q_b_proj_rope_backward");
      query_grads = query_stage->backprop({dq});
    }
    std::vector<at::Tensor> out = needs_payload ? payload_backward(reduce.wait_one())
                                                : std::vector<at::Tensor>(2);
    append(out, query_grads);
    out.push_back(grads.d_weight);
    if (has_bias) out.push_back(grads.d_bias);
    return out;
  };
  std::vector<at::Tensor> attended = attach_backward(inputs, {out}, "LatentScheduleKvRecompute", std::move(backward));
  query_stage->release_outputs();
  return output_stage(ctx, step, attended[0], {}, /*overlap=*/true);
}

}  // namespace

std::unique_ptr<CpSchedule> make_latent_schedule(bool overlap, bool ulysses, bool own_rows, bool kv_recompute) {
  return std::make_unique<LatentSchedule>(overlap, ulysses, own_rows, kv_recompute);
}

}  // namespace mlacp
