// The latent strategy's attention with K/V recomputed (docs/DESIGN.md §5, "K/V recompute"): K and
// V of the head block are expanded from the gathered latent a few heads at a time, used and
// dropped, in the forward and again in the backward. What the backward keeps is the latent
// [B,S,Rkv+Dr], the queries, the output and the log-sum-exps, never the expanded K/V
// [B,S,Hc,Dqk+Dv] (Hc·(Dqk+Dv) = 5120 values a token at DeepSeek-V3's 16 heads, against 576).
//
//   LatentKvAttention a(config, latent, key_rope, weight, bias, scaling, structure, rows);
//   a.compute_rows(q_rows, begin);   // rows [begin, begin+n) now (e.g. under the Q exchange)
//   a.finish_rows(q);                // the others; a.out() [B,Sq,Hc,Dv]
//   a.backward(dout, needs, on_input_grads) -> dq, d latent, d key_rope, d weight, d bias
//
// or finish(q): finish_rows and one autograd node over (q, latent, key_rope, weight, bias), as
// the plain schedule uses it. Both give the same values to the bit (one code path). CPU blockwise
// kernel only. Autocast state of the constructor is re-entered in backward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/timeline.h"
#include "kernels/blockwise_attention.h"
#include "mlacp/config.h"

namespace mlacp {

class LatentKvAttention {
 public:
  // latent [B,S,Rkv] (dense), key_rope [B,S,Dr] rotated (shared by every head), weight
  // [Hc*(Dn+Dv),Rkv] and bias [Hc*(Dn+Dv)] or undefined: kv_b_proj's rows of the head block.
  // `rows` = Sq, the query rows `structure` describes; `sub_heads` heads are expanded at a time
  // (CpPlan::kv_recompute_heads). Tensors are kept as detached aliases.
  LatentKvAttention(const MlaConfig& config, int64_t sub_heads, const at::Tensor& latent, const at::Tensor& key_rope,
                    const at::Tensor& weight, const at::Tensor& bias, double scaling, AttentionStructure structure,
                    int64_t rows, Timeline* timeline = nullptr);
  // Rows [begin, begin+n) of the output from q_rows [B,n,Hc,Dqk] now; no autograd. Every
  // sub-block's K/V is expanded for them (timeline spans "kv_b_proj" and `span`).
  void compute_rows(const at::Tensor& q_rows, int64_t begin, const char* span = "attention_own_rows");
  // The rows not computed yet from q [B,Sq,Hc,Dqk] (spans "kv_b_proj", "attention"); returns
  // out [B,Sq,Hc,Dv] (no autograd).
  const at::Tensor& finish_rows(const at::Tensor& q);
  const at::Tensor& out() const { return out_; }

  struct Needs {
    bool q = true, latent = true, weight = true;  // latent: d latent and d key_rope
  };
  struct Grads {
    at::Tensor dq;          // [B,Sq,Hc,Dqk]
    at::Tensor d_latent;    // [B,S,Rkv], the latent's dtype
    at::Tensor d_key_rope;  // [B,S,Dr], key_rope's dtype
    at::Tensor d_weight, d_bias;
  };
  // Per sub-block: expand K/V again, attention backward, kv_b_proj dgrad into d latent, wgrad.
  // dout [B,Sq,Hc,Dv]. `on_input_grads` (optional) is called once dq, d latent and d key_rope are
  // complete, before the last sub-block's wgrad, so a schedule can launch their exchanges under
  // it; it may move them out (what it leaves is returned). `last_use`: this object drops its
  // forward state (q, out, log-sum-exps, then the latent) as soon as it is read for the last
  // time, so none of it outlives the exchanges; a second backward is then an error.
  using InputGradsReady = std::function<void(Grads&)>;
  Grads backward(at::Tensor dout, Needs needs, const InputGradsReady& on_input_grads = nullptr,
                 bool last_use = false);
  // Rejects an in-place change of q, the latent, the key rope, the rows or the output since the
  // forward (as LibTorch's saved variables do).
  void check_saved() const;

  // finish_rows(q) and one autograd node over (q, latent, key_rope, weight[, bias]) -> out.
  // Pass the same tensors as the constructor's, with their autograd history.
  at::Tensor finish(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& key_rope,
                    const at::Tensor& weight, const at::Tensor& bias);

 private:
  // K [B,S,h,Dqk] and V [B,S,h,Dv] (a view of the projection) of heads [h0, h0+h).
  std::pair<at::Tensor, at::Tensor> expand(int64_t h0, int64_t h) const;

  int64_t nope_, value_dim_, heads_, sub_heads_;
  at::Tensor latent_, key_rope_, weight_, bias_;
  at::Tensor q_, out_, lse_;  // q_ [B,Sq,Hc,Dqk] (finish_rows'), out_ [B,Sq,Hc,Dv]; lse_ [B,Hc,Sq]
  std::shared_ptr<SavedForBackward> saved_;  // version counters of what backward reads
  double scaling_;
  AttentionStructure structure_;
  int64_t rows_;
  Timeline* timeline_;
  compat::AutocastSnapshot autocast_;
  std::vector<std::pair<int64_t, int64_t>> computed_;  // row segments (begin, n)
  bool finished_ = false;
};

}  // namespace mlacp
