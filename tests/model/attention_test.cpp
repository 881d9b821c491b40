#include <map>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "check/cases.h"
#include "check/compare.h"
#include "core/memory_probe.h"
#include "mlacp/attention.h"
#include "mlacp/errors.h"
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


// The Python package makes a HuggingFace module's nn.Parameters the C++ module's parameters.
TEST(MlaAttention, AdoptedParametersAreTheGivenTensors) {
  VerifyCase c{"adopt", preset_config("tiny")};
  c.seed = 1;
  MlaAttention owner = make_case_module(c, at::kDouble);
  c.seed = 2;
  MlaAttention adopter = make_case_module(c, at::kDouble);
  CaseInputs in = make_case_inputs(c, at::kDouble);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : owner->named_parameters()) tensors[item.key()] = item.value();
  adopter->adopt_parameters(tensors);
  for (const auto& item : adopter->named_parameters())
    EXPECT_TRUE(item.value().is_same(tensors.at(item.key()))) << item.key();
  EXPECT_TRUE(at::equal(adopter->forward(in.hidden, in.options), owner->forward(in.hidden, in.options)));
  adopter->forward(in.hidden, in.options).sum().backward();
  for (const auto& item : owner->named_parameters())  // the gradient lands on the owner's tensors
    EXPECT_TRUE(item.value().grad().defined()) << item.key();
}

TEST(MlaAttention, AdoptRejectsMissingExtraAndMisshapenTensors) {
  VerifyCase c{"adopt", preset_config("tiny")};
  MlaAttention m = make_case_module(c, at::kDouble);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : m->named_parameters()) tensors[item.key()] = item.value().detach().clone();
  auto expect_error = [&](std::map<std::string, at::Tensor> given, const std::string& text) {
    try {
      m->adopt_parameters(given);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  auto missing = tensors;
  missing.erase("kv_b_proj.weight");
  expect_error(missing, "every parameter of the module must be given; got missing=kv_b_proj.weight");
  auto extra = tensors;
  extra["q_proj.weight"] = at::zeros({2, 2}, at::kDouble);
  expect_error(extra, "every given tensor must name a parameter of the module; got name=q_proj.weight");
  auto misshapen = tensors;
  misshapen["o_proj.weight"] = at::zeros({3, 3}, at::kDouble);
  expect_error(misshapen, "a given tensor must have the parameter's shape; got name=o_proj.weight");
  auto mixed = tensors;
  mixed["o_proj.weight"] = mixed["o_proj.weight"].to(at::kFloat);
  expect_error(mixed, "all parameters must share one dtype and device");
}

// HuggingFace's position_embeddings (cat(freqs, freqs) layout) replace the config's rope exactly.
TEST(MlaAttention, GivenPositionEmbeddingsEqualTheConfigRope) {
  VerifyCase c{"table", preset_config("tiny")};
  MlaAttention m = make_case_module(c, at::kDouble);
  CaseInputs in = make_case_inputs(c, at::kDouble);
  const ResolvedForward r = MlaLayer::resolve(*m, in.hidden, in.options);
  const RopeTable own = MlaLayer::rope_table(*m, r.rope_positions);
  MlaForwardOptions with_table = in.options;
  with_table.position_embeddings = std::make_pair(at::cat({own.cos, own.cos}, -1), at::cat({own.sin, own.sin}, -1));
  EXPECT_LE(max_abs_error(m->forward(in.hidden, with_table), m->forward(in.hidden, in.options)), 1e-15);
  with_table.position_embeddings->first = with_table.position_embeddings->first.narrow(1, 0, 1);  // one token
  EXPECT_THROW(m->forward(in.hidden, with_table), Error);
}

// MlaConfig::rms_norm_float32: HuggingFace's DeepseekV3RMSNorm order of operations, bit for bit.
TEST(RmsNorm, Float32ModeIsHuggingFacesFormula) {
  RmsNorm norm(8, 1e-6, at::TensorOptions().dtype(at::kDouble), /*always_float32=*/true);
  at::Tensor x = at::randn({3, 8}, at::kDouble);
  {
    at::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
  }
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor hf = norm->weight * (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6)).to(at::kDouble);
  EXPECT_TRUE(at::equal(norm->forward(x), hf));
  RmsNorm reference(8, 1e-6, at::TensorOptions().dtype(at::kDouble));
  reference->weight = norm->weight;
  EXPECT_GT(max_abs_error(reference->forward(x), hf), 0.0);  // float64 throughout differs
}

// With a graph the norm keeps its input only and recomputes the rest in the backward: the
// gradients of the input and the weight are autograd's of the formula's ops, to the bit, in both
// modes, and what the forward leaves alive is its output (the composed ops also keep the
// normalised input, as large as the output). An in-place change of the input is caught.
TEST(RmsNorm, RecomputesInTheBackwardKeepingOnlyTheInput) {
  install_memory_probe();
  for (const bool hf_order : {true, false}) {
    RmsNorm norm(64, 1e-6, at::TensorOptions().dtype(at::kFloat), hf_order);
    {
      at::NoGradGuard no_grad;
      norm->weight.uniform_(0.5, 1.5);
    }
    const at::Tensor x0 = at::randn({4, 256, 64});
    const at::Tensor d_out = at::randn({4, 256, 64});
    const int64_t out_bytes = x0.numel() * 4;

    at::Tensor x = x0.clone().requires_grad_(true), out;
    int64_t kept = 0;
    {
      MemoryScope scope;
      out = norm->forward(x);
      kept = scope.current_extra_bytes();
    }
    EXPECT_EQ(kept, out_bytes) << "hf_order=" << hf_order;
    out.backward(d_out);
    const at::Tensor dx = x.grad().clone(), dw = norm->weight.grad().clone();

    at::Tensor xr = x0.clone().requires_grad_(true), wr = norm->weight.detach().clone().requires_grad_(true), ref;
    int64_t kept_composed = 0;
    {
      MemoryScope scope;
      ref = RmsNormImpl::normalise(xr, wr, 1e-6, hf_order);
      kept_composed = scope.current_extra_bytes();
    }
    EXPECT_GE(kept_composed, 2 * out_bytes) << "hf_order=" << hf_order;
    ref.backward(d_out);
    EXPECT_TRUE(at::equal(out, ref));
    EXPECT_TRUE(at::equal(dx, xr.grad())) << "hf_order=" << hf_order;
    EXPECT_TRUE(at::equal(dw, wr.grad())) << "hf_order=" << hf_order;

    at::Tensor y = norm->forward(x);
    {
      at::NoGradGuard no_grad;
      x.mul_(2);
    }
    EXPECT_THROW(y.sum().backward(), std::exception);
  }
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
