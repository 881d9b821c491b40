// LatentKvAttention (docs/DESIGN.md §5.5, "K/V recompute"): K/V expanded per head sub-block in the
// forward and again in the backward equals kv_b_proj + blockwise attention under autograd, output
// and the gradient of every input (q, latent, key rope, kv_b_proj weight and bias), for sub-blocks
// of one head, of two with a remainder, and of the whole block, with rows computed in segments.
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "kernels/blockwise_attention.h"
#include "mlacp/config.h"
#include "mlacp/errors.h"
#include "model/mla_layer.h"
#include "runtime/latent_kv_attention.h"

namespace mlacp {
namespace {

constexpr int64_t kBatch = 2, kHeads = 5, kRows = 29, kKeys = 43;

MlaConfig config() {
  MlaConfig c = preset_config("tiny");
  c.kv_lora_rank = 11;
  c.qk_nope_head_dim = 6;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 5;
  return c;
}

// Query rows: a head_tail-like subset of the keys' tokens, documents crossing the segments.
AttentionStructure structure() {
  AttentionStructure st;
  st.causal = true;
  std::vector<int64_t> q;
  for (int64_t t = 0; t < kRows; ++t) q.push_back(t < kRows / 2 ? t : kKeys - kRows + t);
  st.query_token_index = at::tensor(q, at::kLong);
  st.key_token_index = at::arange(kKeys, at::kLong);
  st.document_ends = at::tensor(std::vector<int64_t>{9, 30, kKeys}, at::kLong);
  return st;
}

struct Inputs {
  at::Tensor q, latent, key_rope, weight, bias, dout;
};

Inputs make_inputs(const MlaConfig& c) {
  at::manual_seed(5);
  const int64_t width = c.qk_nope_head_dim + c.v_head_dim;
  auto leaf = [](at::Tensor t) { return t.requires_grad_(true); };
  return {leaf(at::randn({kBatch, kRows, kHeads, c.qk_head_dim()}, at::kDouble)),
          leaf(at::randn({kBatch, kKeys, c.kv_lora_rank}, at::kDouble)),
          leaf(at::randn({kBatch, kKeys, c.qk_rope_head_dim}, at::kDouble)),
          leaf(at::randn({kHeads * width, c.kv_lora_rank}, at::kDouble) * 0.3),
          leaf(at::randn({kHeads * width}, at::kDouble)),
          at::randn({kBatch, kRows, kHeads, c.v_head_dim}, at::kDouble)};
}

struct Result {
  at::Tensor out, dq, d_latent, d_key_rope, d_weight, d_bias;
};

Result reference(const MlaConfig& c, const Inputs& in, double scaling) {
  const int64_t width = c.qk_nope_head_dim + c.v_head_dim;
  at::Tensor kv = at::linear(in.latent, in.weight, in.bias).view({kBatch, kKeys, kHeads, width});
  at::Tensor key = MlaLayer::assemble_key(kv.narrow(-1, 0, c.qk_nope_head_dim), in.key_rope);
  at::Tensor value = kv.narrow(-1, c.qk_nope_head_dim, c.v_head_dim);
  at::Tensor out = blockwise_attention(in.q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling,
                                       structure())
                       .transpose(1, 2);
  auto g = torch::autograd::grad({(out * in.dout).sum()}, {in.q, in.latent, in.key_rope, in.weight, in.bias});
  return {out.detach(), g[0], g[1], g[2], g[3], g[4]};
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-12) << what;
}

TEST(LatentKvAttention, EqualsKvProjectionAndAttentionUnderAutograd) {
  const MlaConfig c = config();
  const double scaling = 0.37;
  const Inputs in = make_inputs(c);
  const Result want = reference(c, in, scaling);
  for (int64_t sub_heads : {int64_t{1}, int64_t{2}, kHeads}) {
    LatentKvAttention a(c, sub_heads, in.latent, in.key_rope, in.weight, in.bias, scaling, structure(), kRows);
    a.compute_rows(in.q.detach().narrow(1, 7, 10), 7);  // rows [7, 17) first, as a schedule's own rows
    const at::Tensor out = a.finish(in.q, in.latent, in.key_rope, in.weight, in.bias);
    auto g = torch::autograd::grad({(out * in.dout).sum()}, {in.q, in.latent, in.key_rope, in.weight, in.bias});
    SCOPED_TRACE("sub_heads " + std::to_string(sub_heads));
    expect_close(out.detach(), want.out, "out");
    expect_close(g[0], want.dq, "dq");
    expect_close(g[1], want.d_latent, "d latent");
    expect_close(g[2], want.d_key_rope, "d key_rope");
    expect_close(g[3], want.d_weight, "d weight");
    expect_close(g[4], want.d_bias, "d bias");
  }
}

// The overlapped schedule's use: backward() hands dq, d latent and d key_rope over once complete
// (before the last wgrad), once; what is not needed is not computed.
TEST(LatentKvAttention, HandsTheInputGradientsOverOnceCompleteAndSkipsWhatIsNotNeeded) {
  const MlaConfig c = config();
  const Inputs in = make_inputs(c);
  const Result want = reference(c, in, 0.5);
  LatentKvAttention a(c, 2, in.latent, in.key_rope, in.weight, in.bias, 0.5, structure(), kRows);
  a.finish_rows(in.q.detach());
  int calls = 0;
  LatentKvAttention::Grads handed;
  const LatentKvAttention::Grads g = a.backward(in.dout, {}, [&](LatentKvAttention::Grads& x) {
    ++calls;
    handed = {x.dq.clone(), x.d_latent.clone(), x.d_key_rope.clone(), {}, {}};
  });
  EXPECT_EQ(calls, 1);
  expect_close(handed.dq, want.dq, "handed dq");
  expect_close(handed.d_latent, want.d_latent, "handed d latent");
  expect_close(handed.d_key_rope, want.d_key_rope, "handed d key_rope");
  expect_close(g.d_weight, want.d_weight, "d weight");
  expect_close(g.d_bias, want.d_bias, "d bias");

  const LatentKvAttention::Grads frozen =
      a.backward(in.dout, {/*q=*/true, /*latent=*/false, /*weight=*/false}, nullptr, /*last_use=*/true);
  expect_close(frozen.dq, want.dq, "dq, nothing else needed");
  EXPECT_FALSE(frozen.d_latent.defined() || frozen.d_key_rope.defined() || frozen.d_weight.defined() ||
               frozen.d_bias.defined());
  EXPECT_THROW(a.backward(in.dout, {}), Error);  // its state was dropped at its last use
}

TEST(LatentKvAttention, RejectsMisuseWithItsRule) {
  const MlaConfig c = config();
  const Inputs in = make_inputs(c);
  EXPECT_THROW(LatentKvAttention(c, 1, in.latent, in.key_rope, in.weight.narrow(1, 0, 3), in.bias, 0.5, structure(),
                                 kRows),
               Error);  // weight columns != Rkv
  EXPECT_THROW(LatentKvAttention(c, 1, in.latent, in.key_rope, in.weight, in.bias, 0.5, structure(), kRows - 1),
               Error);  // the structure describes other rows
  LatentKvAttention a(c, 1, in.latent, in.key_rope, in.weight, in.bias, 0.5, structure(), kRows);
  a.compute_rows(in.q.detach().narrow(1, 0, 4), 0);
  EXPECT_THROW(a.compute_rows(in.q.detach().narrow(1, 2, 4), 2), Error);  // overlapping segments
  EXPECT_THROW(a.backward(in.dout, {}), Error);                            // before the forward is finished
  a.finish_rows(in.q.detach());
  EXPECT_THROW(a.finish_rows(in.q.detach()), Error);
  a.out().add_(1.0);  // an in-place change of what the backward reads
  EXPECT_THROW(a.backward(in.dout, {}), Error);
}

}  // namespace
}  // namespace mlacp
