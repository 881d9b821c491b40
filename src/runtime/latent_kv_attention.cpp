#include "runtime/latent_kv_attention.h"

#include <algorithm>
#include <memory>

#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "core/format.h"
#include "kernels/segmented_attention.h"
#include "mlacp/errors.h"
#include "model/mla_layer.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "latent K/V recompute";

// The rows of `structure` not yet in `computed` (sorted by begin): the gaps, in order.
std::vector<std::pair<int64_t, int64_t>> missing_rows(std::vector<std::pair<int64_t, int64_t>> computed, int64_t rows) {
  std::sort(computed.begin(), computed.end());
  std::vector<std::pair<int64_t, int64_t>> gaps;
  int64_t next = 0;
  for (const auto& [begin, n] : computed) {
    if (begin > next) gaps.emplace_back(next, begin - next);
    next = begin + n;
  }
  if (next < rows) gaps.emplace_back(next, rows - next);
  return gaps;
}

}  // namespace

LatentKvAttention::LatentKvAttention(const MlaConfig& c, int64_t sub_heads, const at::Tensor& latent, const at::Tensor& key_rope,
                                     const at::Tensor& weight, const at::Tensor& bias, double scaling,
                                     AttentionStructure structure, int64_t rows, Timeline* timeline)
    : nope_(c.qk_nope_head_dim),
      value_dim_(c.v_head_dim),
      heads_(weight.dim() == 2 ? weight.size(0) / (c.qk_nope_head_dim + c.v_head_dim) : 0),
      sub_heads_(std::max<int64_t>(1, sub_heads)),
      latent_(latent.detach()),
      key_rope_(key_rope.detach()),
      weight_(weight.detach()),
      bias_(bias.defined() ? bias.detach() : at::Tensor()),
      scaling_(scaling),
      structure_(std::move(structure)),
      rows_(rows),
      timeline_(timeline),
      autocast_(compat::AutocastSnapshot::capture(latent.device().type())) {
  const int64_t width = c.qk_nope_head_dim + c.v_head_dim;
  MLACP_REQUIRE(latent.dim() == 3 && latent.size(2) == c.kv_lora_rank && key_rope.dim() == 3 &&
                    key_rope.size(2) == c.qk_rope_head_dim && key_rope.size(0) == latent.size(0) &&
                    key_rope.size(1) == latent.size(1) && weight.dim() == 2 && weight.size(1) == c.kv_lora_rank &&
                    heads_ > 0 && weight.size(0) == heads_ * width &&
                    (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0))),
                kWhat, "takes latent [B,S,Rkv], key_rope [B,S,Dr] and kv_b_proj rows [h*(Dn+Dv),Rkv]",
                {got("latent", shape_text(latent)), got("key_rope", shape_text(key_rope)),
                 got("weight", shape_text(weight)), got("Rkv", c.kv_lora_rank), got("Dn+Dv", width)},
                "pass the gathered latent and the head block's kv_b_proj rows");
  // device: K/V recompute runs the CPU blockwise kernel's forward and backward halves
  MLACP_REQUIRE(latent.device().is_cpu(), kWhat, "runs the CPU blockwise kernel", {got("device", latent.device())},
                "turn kv_recompute off on this device");
  MLACP_REQUIRE(structure_.query_token_index.defined() && structure_.query_token_index.size(0) == rows, kWhat,
                "the structure must describe every query row",
                {got("rows", rows), got("structure_rows", structure_.query_token_index.defined()
                                                                ? structure_.query_token_index.size(0)
                                                                : -1)},
                "pass the structure of all rows the output will have");
}

std::pair<at::Tensor, at::Tensor> LatentKvAttention::expand(int64_t h0, int64_t h) const {
  ComputeSpan span(timeline_, "kv_b_proj");
  const int64_t width = nope_ + value_dim_;
  const at::Tensor w = weight_.narrow(0, h0 * width, h * width);
  const at::Tensor b = bias_.defined() ? bias_.narrow(0, h0 * width, h * width) : at::Tensor();
  const at::Tensor projected = at::linear(latent_, w, b);  // [B,S,h*(Dn+Dv)]
  const at::Tensor kv = projected.view({projected.size(0), projected.size(1), h, width});
  const at::Tensor key = MlaLayer::assemble_key(kv.narrow(-1, 0, nope_), key_rope_);  // [B,S,h,Dqk] dense
  return {key, kv.narrow(-1, nope_, value_dim_)};                                   // V: a view, last dim dense
}

void LatentKvAttention::compute_rows(const at::Tensor& q_rows, int64_t begin, const char* span) {
  MLACP_REQUIRE(!finished_, kWhat, "rows computed after finish_rows()", {got("begin", begin)},
                "compute the early rows first");
  const int64_t n = q_rows.dim() == 4 ? q_rows.size(1) : -1;
  MLACP_REQUIRE(n >= 0 && begin >= 0 && begin + n <= rows_ && q_rows.size(2) == heads_, kWhat,
                "q rows must be [B,n,Hc,Dqk] inside [0, Sq)",
                {got("q_rows", shape_text(q_rows)), got("begin", begin), got("rows", rows_), got("heads", heads_)},
                "pass the query rows of the head block and their first row index");
  for (const auto& [b, m] : computed_)
    MLACP_REQUIRE(begin + n <= b || b + m <= begin, kWhat, "row segments must not overlap",
                  {got("begin", begin), got("rows", n), got("computed_begin", b)}, "compute each row once");
  if (n == 0) return;
  at::NoGradGuard no_grad;
  if (!out_.defined())
    out_ = at::empty({q_rows.size(0), rows_, heads_, value_dim_}, q_rows.options());  // [B,Sq,Hc,Dv]
  const AttentionStructure rows = query_rows_of(structure_, begin, n);
  for (int64_t h0 = 0; h0 < heads_; h0 += sub_heads_) {
    const int64_t h = std::min(sub_heads_, heads_ - h0);
    auto [key, value] = expand(h0, h);
    ComputeSpan attention(timeline_, span);
    const at::Tensor lse = blockwise_attention_forward_into(
        q_rows.narrow(2, h0, h).transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling_, rows,
        out_.narrow(1, begin, n).narrow(2, h0, h).transpose(1, 2));  // [B,h,n]
    if (!lse_.defined()) lse_ = at::empty({q_rows.size(0), heads_, rows_}, lse.options());
    lse_.narrow(1, h0, h).narrow(2, begin, n).copy_(lse);
  }
  computed_.emplace_back(begin, n);
}

const at::Tensor& LatentKvAttention::finish_rows(const at::Tensor& q) {
  MLACP_REQUIRE(!finished_, kWhat, "finish_rows() called twice", {}, "finish once per forward");
  MLACP_REQUIRE(q.dim() == 4 && q.size(1) == rows_, kWhat, "q must hold every query row",
                {got("q", shape_text(q)), got("rows", rows_)}, "pass q [B,Sq,Hc,Dqk]");
  for (const auto& [begin, n] : missing_rows(computed_, rows_)) compute_rows(q.narrow(1, begin, n), begin, "attention");
  finished_ = true;
  q_ = q.detach();
  saved_ = std::make_shared<SavedForBackward>(std::vector<at::Tensor>{q_, latent_, key_rope_, weight_, out_},
                                              std::vector<std::string>{"q", "latent", "key_rope", "kv_b_proj rows", "out"});
  return out_;
}

void LatentKvAttention::check_saved() const {
  MLACP_REQUIRE(saved_ != nullptr, kWhat, "backward before finish_rows(), or after its last use", {},
                "finish the forward first; pass last_use only to the last backward");
  saved_->check(kWhat);
}

LatentKvAttention::Grads LatentKvAttention::backward(at::Tensor dout, Needs needs, const InputGradsReady& on_input_grads,
                                                     bool last_use) {
  check_saved();
  at::NoGradGuard no_grad;
  const auto autocast_guard = autocast_.enter();
  if (dout.scalar_type() != out_.scalar_type()) dout = dout.to(out_.scalar_type());
  at::Tensor q = q_;
  const int64_t width = nope_ + value_dim_, batch = latent_.size(0), keys = latent_.size(1);
  const at::Tensor latent_2d = latent_.view({batch * keys, latent_.size(2)});
  Grads g;
  g.dq = at::empty_like(q);
  // Sums over sub-blocks in float32 (float64 for float64): one rounding to the latent's dtype.
  const at::ScalarType acc = latent_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor d_latent, d_key_rope;
  if (needs.latent) {
    d_latent = at::zeros({batch * keys, latent_.size(2)}, latent_.options().dtype(acc));
    d_key_rope = at::zeros(key_rope_.sizes(), key_rope_.options().dtype(acc));
  }
  if (needs.weight) {
    g.d_weight = at::empty_like(weight_);
    if (bias_.defined()) g.d_bias = at::empty_like(bias_);
  }
  at::Tensor last_d_projected;  // the last sub-block's: its wgrad runs after on_input_grads
  int64_t last_h0 = 0;
  auto wgrad = [&](const at::Tensor& d_projected, int64_t h0, int64_t h) {
    ComputeSpan span(timeline_, "kv_b_proj_wgrad");
    g.d_weight.narrow(0, h0 * width, h * width).copy_(d_projected.t().mm(latent_2d));
    if (bias_.defined()) g.d_bias.narrow(0, h0 * width, h * width).copy_(d_projected.sum(0));
  };
  for (int64_t h0 = 0; h0 < heads_; h0 += sub_heads_) {
    const int64_t h = std::min(sub_heads_, heads_ - h0);
    auto [key, value] = expand(h0, h);
    at::Tensor d_key = at::empty_like(key);                                  // [B,S,h,Dqk]
    at::Tensor d_projected = at::empty({batch, keys, h, width}, key.options());  // [B,S,h,Dn+Dv]
    {
      ComputeSpan span(timeline_, "attention_backward");
      const at::Tensor t_out = out_.narrow(2, h0, h).transpose(1, 2);
      blockwise_attention_backward_into(q.narrow(2, h0, h).transpose(1, 2), key.transpose(1, 2),
                                        value.transpose(1, 2), t_out, lse_.narrow(1, h0, h),
                                        dout.narrow(2, h0, h).transpose(1, 2), at::Tensor(), scaling_, structure_,
                                        {g.dq.narrow(2, h0, h).transpose(1, 2), d_key.transpose(1, 2),
                                         d_projected.narrow(-1, nope_, value_dim_).transpose(1, 2)},
                                        /*accumulate_kv=*/false);
    }
    key = value = at::Tensor();
    if (!needs.latent && !needs.weight) continue;
    d_projected.narrow(-1, 0, nope_).copy_(d_key.narrow(-1, 0, nope_));
    if (needs.latent) d_key_rope.add_(d_key.narrow(-1, nope_, d_key.size(-1) - nope_).sum(2));
    d_key = at::Tensor();
    d_projected = d_projected.view({batch * keys, h * width});
    if (needs.latent) {
      ComputeSpan span(timeline_, "kv_b_proj_dgrad");
      d_latent.add_(d_projected.mm(weight_.narrow(0, h0 * width, h * width)));
    }
    if (!needs.weight) continue;
    if (h0 + h < heads_) {
      wgrad(d_projected, h0, h);
    } else {
      last_d_projected = d_projected;
      last_h0 = h0;
    }
  }
  if (needs.latent) {
    g.d_latent = d_latent.view(latent_.sizes()).to(latent_.scalar_type());
    g.d_key_rope = d_key_rope.to(key_rope_.scalar_type());
    d_latent = d_key_rope = at::Tensor();  // the float32 sums, when they were not the results themselves
  }
  if (last_use) {  // the attention is done: only the latent and the rows remain for the last wgrad
    dout = at::Tensor();
    saved_.reset();
    q = q_ = out_ = lse_ = key_rope_ = at::Tensor();
  }
  if (!needs.q) g.dq = at::Tensor();
  if (on_input_grads) on_input_grads(g);
  if (last_d_projected.defined()) wgrad(last_d_projected, last_h0, std::min(sub_heads_, heads_ - last_h0));
  if (last_use) latent_ = weight_ = bias_ = at::Tensor();
  return g;
}

at::Tensor LatentKvAttention::finish(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& key_rope,
                                     const at::Tensor& weight, const at::Tensor& bias) {
  finish_rows(q.detach());
  const bool has_bias = bias.defined();
  std::vector<at::Tensor> inputs{q, latent, key_rope, weight};
  if (has_bias) inputs.push_back(bias);
  const Needs needs{q.requires_grad(), latent.requires_grad() || key_rope.requires_grad(),
                    weight.requires_grad() || (has_bias && bias.requires_grad())};
  // The node owns this object's state (latent, lse, ...) until its backward has run.
  auto self = std::make_shared<LatentKvAttention>(*this);
  BackwardFn backward = [self, needs, has_bias](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
    Grads g = self->backward(std::move(grads[0]), needs, nullptr, /*last_use=*/true);
    std::vector<at::Tensor> out{g.dq, g.d_latent, g.d_key_rope, g.d_weight};
    if (has_bias) out.push_back(g.d_bias);
    return out;
  };
  return attach_backward(inputs, {out_}, "LatentKvAttentionBackward", std::move(backward))[0];
}

}  // namespace mlacp
