#include <set>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "check/cases.h"
#include "check/compare.h"
#include "mlacp/attention.h"
#include "model/mla_layer.h"

namespace mlacp {
namespace {

std::set<std::string> parameter_names(MlaAttention& m) {
  std::set<std::string> names;
  for (const auto& item : m->named_parameters()) names.insert(item.key());
  return names;
}

TEST(MlaAttention, ParametersAreNamedAsInDeepSeekCheckpoints) {
  MlaConfig c = preset_config("tiny");
  MlaAttention plain(c);
  EXPECT_EQ(parameter_names(plain),
            (std::set<std::string>{"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                                   "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                                   "o_proj.weight"}));
  c.output_gate = true;
  c.attention_bias = true;
  MlaAttention gated(c);
  EXPECT_TRUE(parameter_names(gated).count("o_gate_proj.weight"));
  EXPECT_TRUE(parameter_names(gated).count("q_a_proj.bias"));
  EXPECT_TRUE(parameter_names(gated).count("o_proj.bias"));
  EXPECT_FALSE(parameter_names(gated).count("q_b_proj.bias"));
}

TEST(MlaAttention, DeepSeekV2LiteShapesMatchTheCheckpoint) {
  MlaAttention m(preset_config("deepseek-v2-lite"));
  auto params = m->named_parameters();
  EXPECT_EQ(params["q_proj.weight"].sizes(), (std::vector<int64_t>{16 * 192, 2048}));
  EXPECT_EQ(params["kv_a_proj_with_mqa.weight"].sizes(), (std::vector<int64_t>{576, 2048}));
  EXPECT_EQ(params["kv_a_layernorm.weight"].sizes(), (std::vector<int64_t>{512}));
  EXPECT_EQ(params["kv_b_proj.weight"].sizes(), (std::vector<int64_t>{16 * 256, 512}));
  EXPECT_EQ(params["o_proj.weight"].sizes(), (std::vector<int64_t>{2048, 16 * 128}));
  EXPECT_FALSE(params.contains("q_a_proj.weight"));
}

// Interleaved lanes de-interleave to [0, 2, 4, ..., 1, 3, 5, ...]: writing half-split row i into
// interleaved row src(i) makes both layouts compute the same rotated vectors.
at::Tensor interleave_rope_rows(const at::Tensor& weight, int64_t block, int64_t rope_offset, int64_t rope_dim) {
  at::Tensor out = weight.clone();
  const int64_t half = rope_dim / 2;
  for (int64_t b = 0; b < weight.size(0) / block; ++b) {
    for (int64_t i = 0; i < rope_dim; ++i) {
      const int64_t src = i < half ? 2 * i : 2 * (i - half) + 1;
      out[b * block + rope_offset + src].copy_(weight[b * block + rope_offset + i]);
    }
  }
  return out;
}

TEST(MlaAttention, InterleavedAndHalfSplitAgreeWithPermutedWeights) {
  VerifyCase c{"layouts", preset_config("tiny")};
  c.config.qk_rope_head_dim = 6;
  c.seq_len = 7;
  MlaAttention half = make_case_module(c, at::kDouble);
  c.config.rope_layout = RopeLayout::interleaved;
  MlaAttention inter = make_case_module(c, at::kDouble);
  const MlaConfig& cfg = c.config;
  {
    at::NoGradGuard no_grad;
    inter->q_b_proj->weight.copy_(
        interleave_rope_rows(half->q_b_proj->weight, cfg.qk_head_dim(), cfg.qk_nope_head_dim, cfg.qk_rope_head_dim));
    inter->kv_a_proj_with_mqa->weight.copy_(interleave_rope_rows(
        half->kv_a_proj_with_mqa->weight, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank,
        cfg.qk_rope_head_dim));
  }
  CaseInputs in = make_case_inputs(c, at::kDouble);
  at::Tensor a = half->forward(in.hidden, in.options);
  at::Tensor b = inter->forward(in.hidden, in.options);
  EXPECT_LT(max_abs_error(a, b), 1e-13);
  // Without the permutation they differ (the test can fail).
  MlaAttention unpermuted = make_case_module(c, at::kDouble);
  EXPECT_GT(max_abs_error(a, unpermuted->forward(in.hidden, in.options)), 1e-6);
}

TEST(MlaAttention, PackedBatchEqualsDocumentsRunSeparately) {
  VerifyCase c{"packed", preset_config("tiny")};
  c.batch = 1;
  c.seq_len = 13;
  MlaAttention m = make_case_module(c, at::kDouble);
  CaseInputs in = make_case_inputs(c, at::kDouble);
  const std::vector<int64_t> ends{0, 5, 6, 13};  // cu_seqlens form, a one-token document
  in.options.document_ends = ends;
  at::Tensor packed = m->forward(in.hidden, in.options);
  for (size_t d = 1; d < ends.size(); ++d) {
    at::Tensor alone = m->forward(in.hidden.narrow(1, ends[d - 1], ends[d] - ends[d - 1]));
    EXPECT_LT(max_abs_error(packed.narrow(1, ends[d - 1], ends[d] - ends[d - 1]), alone), 1e-14);
  }
  // Unpacked, the same tokens see each other: the results differ.
  EXPECT_GT(max_abs_error(packed, m->forward(in.hidden)), 1e-6);
}

TEST(MlaAttention, ExplicitScalingIsUsedAsGiven) {
  VerifyCase c{"scale", preset_config("tiny")};
  c.config.softmax_scale = 0.125;
  MlaAttention m = make_case_module(c, at::kDouble);
  EXPECT_EQ(m->scaling(), 0.125);
  CaseInputs in = make_case_inputs(c, at::kDouble);
  at::Tensor with_scale = m->forward(in.hidden, in.options);
  c.config.softmax_scale.reset();
  MlaAttention d = make_case_module(c, at::kDouble);
  EXPECT_GT(max_abs_error(with_scale, d->forward(in.hidden, in.options)), 1e-6);
}

TEST(MlaAttention, ForwardIsTheComposedSeam) {
  VerifyCase c{"seam", preset_config("tiny")};
  c.config.output_gate = true;
  MlaAttention m = make_case_module(c, at::kDouble);
  CaseInputs in = make_case_inputs(c, at::kDouble);
  const ResolvedForward r = MlaLayer::resolve(*m, in.hidden, in.options);
  at::Tensor composed = MlaLayer::project_output(*m, MlaLayer::single_device_core(*m, MlaLayer::compute_latents(*m, in.hidden), r), in.hidden);
  EXPECT_TRUE(at::equal(composed, m->forward(in.hidden, in.options)));
}

TEST(MlaAttention, HeadRangeGradientLandsOnlyInThoseRows) {
  VerifyCase c{"rows", preset_config("tiny")};
  MlaAttention m = make_case_module(c, at::kDouble);
  CaseInputs in = make_case_inputs(c, at::kDouble);
  LocalLatents l = MlaLayer::compute_latents(*m, in.hidden);
  at::Tensor pos = at::arange(c.seq_len, at::kLong).unsqueeze(0).expand({c.batch, c.seq_len});
  auto [key, value] = MlaLayer::expand_key_value(*m, l.kv_latent, MlaLayer::rotate_key(l.key_rope_raw, MlaLayer::rope_table(*m, pos)), 1, 3);
  (key.sum() + value.sum()).backward();
  const int64_t width = c.config.qk_nope_head_dim + c.config.v_head_dim;
  at::Tensor g = m->kv_b_proj->weight.grad();
  EXPECT_EQ(g.narrow(0, 0, width).abs().max().item<double>(), 0.0);
  EXPECT_EQ(g.narrow(0, 3 * width, width).abs().max().item<double>(), 0.0);
  EXPECT_GT(g.narrow(0, width, 2 * width).abs().min().item<double>(), 0.0);
}

}  // namespace
}  // namespace mlacp

namespace mlacp {
namespace {

// The fast kernel is the default of a fresh module (single device too); the reference kernel is
// chosen explicitly and gives the same results (float64).
TEST(MlaAttention, DefaultsToTheBlockwiseKernelAndMatchesTheReference) {
  VerifyCase c{"default-kernel", preset_config("tiny")};
  c.seq_len = 23;
  MlaAttention fresh(c.config, at::TensorOptions().dtype(at::kDouble));
  EXPECT_EQ(fresh->attention_kernel(), AttentionKernel::blockwise);
  MlaAttention fast = make_case_module(c, at::kDouble);
  MlaAttention reference = make_case_module(c, at::kDouble);
  EXPECT_EQ(reference->attention_kernel(), AttentionKernel::reference);  // a case module is an oracle
  fast->set_attention_kernel(AttentionKernel::blockwise);
  const CaseInputs in = make_case_inputs(c, at::kDouble);
  at::Tensor x_fast = in.hidden.clone().requires_grad_(true), x_ref = in.hidden.clone().requires_grad_(true);
  at::Tensor y_fast = fast->forward(x_fast, in.options), y_ref = reference->forward(x_ref, in.options);
  EXPECT_LE(max_abs_error(y_fast, y_ref), 1e-13);
  (y_fast * in.output_weight).sum().backward();
  (y_ref * in.output_weight).sum().backward();
  EXPECT_LE(max_abs_error(x_fast.grad(), x_ref.grad()), 1e-13);
  auto fast_params = fast->named_parameters(), ref_params = reference->named_parameters();
  for (const auto& item : ref_params)
    EXPECT_LE(max_abs_error(fast_params[item.key()].grad(), item.value().grad()), 1e-12) << item.key();
}

}  // namespace
}  // namespace mlacp
