// Forward-time rejections of MlaAttention (docs/DESIGN.md §6, §8): one test per rule of
// resolve_forward_inputs, MlaAttentionImpl::validate_latents and expand_key_value. Each checks
// that the mlacp::Error names the rule and the offending value; the accepted neighbours of each
// rule are checked to pass.
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "support/error_of.h"
#include "mlacp/attention.h"
#include "mlacp/errors.h"
#include "model/mla_layer.h"

namespace mlacp {
namespace {

using ::testing::HasSubstr;

using test::error_of;

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 6;

class Rejections : public ::testing::Test {
 protected:
  void SetUp() override {
    at::manual_seed(7);
    hidden = at::randn({kBatch, kSeq, config.hidden_size}, double_options);
    packed_hidden = at::randn({1, kSeq, config.hidden_size}, double_options);
  }

  // Runs the whole forward and checks the output's shape.
  void expect_forward_ok(const at::Tensor& input, const MlaForwardOptions& options) {
    at::Tensor out;
    try {
      out = module->forward(input, options);
    } catch (const std::exception& e) {
      FAIL() << "forward threw: " << e.what();
    }
    EXPECT_EQ(out.sizes(), input.sizes());
    EXPECT_TRUE(at::isfinite(out).all().item<bool>());
  }

  std::string forward_error(const at::Tensor& input, const MlaForwardOptions& options) {
    return error_of([&] { module->forward(input, options); });
  }

  std::string core_error(const LocalLatents& latents) {
    const ResolvedForward resolved = MlaLayer::resolve(*module, hidden, {});
    return error_of([&] { MlaLayer::single_device_core(*module, latents, resolved); });
  }

  at::TensorOptions double_options = at::TensorOptions().dtype(at::kDouble);
  MlaConfig config = preset_config("tiny");
  MlaAttention module{config, at::TensorOptions().dtype(at::kDouble)};
  at::Tensor hidden;         // [2, 6, 12]
  at::Tensor packed_hidden;  // [1, 6, 12]
};

at::Tensor bool_ones(at::IntArrayRef sizes) { return at::ones(sizes, at::TensorOptions().dtype(at::kBool)); }
at::Tensor long_tensor(const std::vector<int64_t>& values) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong));
}

TEST_F(Rejections, BaselineForwardIsAccepted) { expect_forward_ok(hidden, {}); }

// ---------------------------------------------------------------------------------------------
// Hidden states

TEST_F(Rejections, HiddenNot3D) {
  const std::string msg = forward_error(hidden.reshape({kBatch * kSeq, config.hidden_size}), {});
  EXPECT_THAT(msg, HasSubstr("hidden states must be 3-D [B, S, hidden]"));
  EXPECT_THAT(msg, HasSubstr("shape=[12, 12]"));
}

TEST_F(Rejections, HiddenUndefined) {
  const std::string msg = forward_error(at::Tensor(), {});
  EXPECT_THAT(msg, HasSubstr("hidden states must be a defined tensor"));
}

TEST_F(Rejections, HiddenIntegerDtype) {
  const std::string msg =
      forward_error(at::zeros({kBatch, kSeq, config.hidden_size}, at::TensorOptions().dtype(at::kLong)), {});
  EXPECT_THAT(msg, HasSubstr("hidden states must be floating point"));
  EXPECT_THAT(msg, HasSubstr("dtype=int64"));
}

TEST_F(Rejections, HiddenEmpty) {
  std::string msg = forward_error(at::zeros({kBatch, 0, config.hidden_size}, double_options), {});
  EXPECT_THAT(msg, HasSubstr("hidden states must not be empty"));
  EXPECT_THAT(msg, HasSubstr("shape=[2, 0, 12]"));
  msg = forward_error(at::zeros({0, kSeq, config.hidden_size}, double_options), {});
  EXPECT_THAT(msg, HasSubstr("hidden states must not be empty"));
  EXPECT_THAT(msg, HasSubstr("shape=[0, 6, 12]"));
}

TEST_F(Rejections, HiddenWrongSize) {
  const std::string msg = forward_error(at::zeros({kBatch, kSeq, 11}, double_options), {});
  EXPECT_THAT(msg, HasSubstr("last dim of hidden states must equal hidden_size"));
  EXPECT_THAT(msg, HasSubstr("hidden.size(-1)=11"));
  EXPECT_THAT(msg, HasSubstr("hidden_size=12"));
}

// ---------------------------------------------------------------------------------------------
// Unsupported options

TEST_F(Rejections, UseCache) {
  MlaForwardOptions o;
  o.use_cache = true;
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("KV cache is not supported"));
  EXPECT_THAT(msg, HasSubstr("use_cache=true"));
}

TEST_F(Rejections, OutputAttentions) {
  MlaForwardOptions o;
  o.output_attentions = true;
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("attention weights cannot be returned"));
  EXPECT_THAT(msg, HasSubstr("output_attentions=true"));
}

TEST_F(Rejections, NegativeDropout) {
  for (bool training : {true, false}) {
    module->train(training);
    MlaForwardOptions o;
    o.dropout = -0.25;
    const std::string msg = forward_error(hidden, o);
    EXPECT_THAT(msg, HasSubstr("dropout must be finite and >= 0")) << "training=" << training;
    EXPECT_THAT(msg, HasSubstr("dropout=-0.25")) << "training=" << training;
  }
}

TEST_F(Rejections, NonFiniteDropout) {
  module->eval();
  MlaForwardOptions o;
  o.dropout = std::numeric_limits<double>::infinity();
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("dropout must be finite and >= 0"));
  EXPECT_THAT(msg, HasSubstr("dropout=inf"));
}

TEST_F(Rejections, DropoutInTrainingRejectedButAcceptedInEval) {
  MlaForwardOptions o;
  o.dropout = 0.1;
  module->train();
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("attention dropout must be 0 in training"));
  EXPECT_THAT(msg, HasSubstr("dropout=0.1"));
  EXPECT_THAT(msg, HasSubstr("training=true"));

  module->eval();
  expect_forward_ok(hidden, o);
}

// ---------------------------------------------------------------------------------------------
// Document boundaries (packed sequences)

TEST_F(Rejections, DocumentEndsAndLengthsBothGiven) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{2, 6};
  o.document_lengths = std::vector<int64_t>{2, 4};
  const std::string msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("document_ends and document_lengths are both given"));
  EXPECT_THAT(msg, HasSubstr("document_ends=[2, 6]"));
  EXPECT_THAT(msg, HasSubstr("document_lengths=[2, 4]"));
}

TEST_F(Rejections, NonPositiveDocumentLength) {
  for (int64_t bad : {int64_t{0}, int64_t{-1}}) {
    MlaForwardOptions o;
    o.document_lengths = std::vector<int64_t>{3, bad, 3 - bad};
    const std::string msg = forward_error(packed_hidden, o);
    EXPECT_THAT(msg, HasSubstr("document_lengths must all be > 0"));
    EXPECT_THAT(msg, HasSubstr("document_lengths=[3, " + std::to_string(bad) + ", " + std::to_string(3 - bad) + "]"));
  }
}

TEST_F(Rejections, DocumentLengthsAccepted) {
  MlaForwardOptions o;
  o.document_lengths = std::vector<int64_t>{2, 4};
  const ResolvedForward r = MlaLayer::resolve(*module, packed_hidden, o);
  EXPECT_TRUE(at::equal(r.document_ends, long_tensor({2, 6})));
  EXPECT_TRUE(at::equal(r.rope_positions, long_tensor({0, 1, 0, 1, 2, 3}).unsqueeze(0)));
  expect_forward_ok(packed_hidden, o);
}

TEST_F(Rejections, KeyDocumentEndsWithoutDocumentEnds) {
  MlaForwardOptions o;
  o.key_document_ends = std::vector<int64_t>{3, 6};
  const std::string msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("key_document_ends given without query document ends"));
  EXPECT_THAT(msg, HasSubstr("key_document_ends=[3, 6]"));
}

TEST_F(Rejections, PackedWithBatchAboveOne) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{3, 6};
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("packed sequences need batch 1"));
  EXPECT_THAT(msg, HasSubstr("batch=2"));
}

TEST_F(Rejections, DocumentEndsNotStrictlyIncreasing) {
  for (const std::vector<int64_t>& ends : {std::vector<int64_t>{3, 3, 6}, std::vector<int64_t>{4, 2, 6}}) {
    MlaForwardOptions o;
    o.document_ends = ends;
    const std::string msg = forward_error(packed_hidden, o);
    EXPECT_THAT(msg, HasSubstr("document_ends must be strictly increasing and positive"));
    EXPECT_THAT(msg, HasSubstr("document_ends=[" + std::to_string(ends[0]) + ", " + std::to_string(ends[1]) + ", 6]"));
  }
}

TEST_F(Rejections, DocumentEndsNotEndingAtTokenCount) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{3, 5};
  std::string msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("document_ends must end at the token count"));
  EXPECT_THAT(msg, HasSubstr("document_ends=[3, 5]"));
  EXPECT_THAT(msg, HasSubstr("last=5"));
  EXPECT_THAT(msg, HasSubstr("tokens=6"));

  o.document_ends = std::vector<int64_t>{3, 7};
  msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("document_ends must end at the token count"));
  EXPECT_THAT(msg, HasSubstr("last=7"));
}

TEST_F(Rejections, DocumentEndsEmpty) {
  for (const std::vector<int64_t>& ends : {std::vector<int64_t>{}, std::vector<int64_t>{0}}) {
    MlaForwardOptions o;
    o.document_ends = ends;
    const std::string msg = forward_error(packed_hidden, o);
    EXPECT_THAT(msg, HasSubstr("document_ends must name at least one document"));
  }
}

TEST_F(Rejections, CuSeqlensWithLeadingZeroAccepted) {
  MlaForwardOptions with_zero;
  with_zero.document_ends = std::vector<int64_t>{0, 2, 6};
  MlaForwardOptions without_zero;
  without_zero.document_ends = std::vector<int64_t>{2, 6};
  const ResolvedForward r = MlaLayer::resolve(*module, packed_hidden, with_zero);
  EXPECT_TRUE(at::equal(r.document_ends, long_tensor({2, 6})));
  EXPECT_TRUE(at::equal(r.rope_positions, long_tensor({0, 1, 0, 1, 2, 3}).unsqueeze(0)));
  at::Tensor a = module->forward(packed_hidden, with_zero);
  at::Tensor b = module->forward(packed_hidden, without_zero);
  EXPECT_TRUE(at::equal(a, b));
}

TEST_F(Rejections, KeyDocumentEndsDifferFromDocumentEnds) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{2, 6};
  o.key_document_ends = std::vector<int64_t>{3, 6};
  const std::string msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("query and key document boundaries must be identical"));
  EXPECT_THAT(msg, HasSubstr("document_ends=[2, 6]"));
  EXPECT_THAT(msg, HasSubstr("key_document_ends=[3, 6]"));
}

TEST_F(Rejections, KeyDocumentEndsEqualAccepted) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{2, 6};
  o.key_document_ends = std::vector<int64_t>{0, 2, 6};  // cu_seqlens spelling of the same ends
  expect_forward_ok(packed_hidden, o);
}

// ---------------------------------------------------------------------------------------------
// Attention mask

TEST_F(Rejections, MaskWithPacking) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{3, 6};
  o.attention_mask = bool_ones({kSeq, kSeq});
  const std::string msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("packed sequences and an explicit attention mask are mutually exclusive"));
  EXPECT_THAT(msg, HasSubstr("mask.shape=[6, 6]"));
}

TEST_F(Rejections, MaskNotBool) {
  MlaForwardOptions o;
  o.attention_mask = at::zeros({kSeq, kSeq}, double_options);  // additive 0/-inf bias style
  std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("attention_mask must be boolean"));
  EXPECT_THAT(msg, HasSubstr("mask.dtype=float64"));

  o.attention_mask = at::zeros({kSeq, kSeq}, at::TensorOptions().dtype(at::kFloat));
  msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("additive bias masks are not supported"));
  EXPECT_THAT(msg, HasSubstr("mask.dtype=float32"));
}

TEST_F(Rejections, MaskWrongShape) {
  const std::vector<std::pair<std::vector<int64_t>, std::string>> bad = {
      {{kSeq, kSeq + 1}, "mask.shape=[6, 7]"},
      {{kSeq}, "mask.shape=[6]"},
      {{3, 1, kSeq, kSeq}, "mask.shape=[3, 1, 6, 6]"},
      {{kBatch, 2, kSeq, kSeq}, "mask.shape=[2, 2, 6, 6]"},
      {{1, kSeq, kSeq}, "mask.shape=[1, 6, 6]"},
  };
  for (const auto& [sizes, shown] : bad) {
    MlaForwardOptions o;
    o.attention_mask = bool_ones(sizes);
    const std::string msg = forward_error(hidden, o);
    EXPECT_THAT(msg, HasSubstr("attention_mask must be [S, S] or [B|1, 1, S, S]"));
    EXPECT_THAT(msg, HasSubstr(shown));
    EXPECT_THAT(msg, HasSubstr("B=2"));
    EXPECT_THAT(msg, HasSubstr("S=6"));
  }
}

TEST_F(Rejections, MaskShapesAccepted) {
  // A band mask; all three shapes describe the same mask, so the outputs agree.
  at::Tensor band = (at::arange(kSeq).unsqueeze(1) - at::arange(kSeq).unsqueeze(0)).abs() < 3;  // [S, S]
  MlaForwardOptions square, one, batched;
  square.attention_mask = band;
  one.attention_mask = band.view({1, 1, kSeq, kSeq});
  batched.attention_mask = band.view({1, 1, kSeq, kSeq}).expand({kBatch, 1, kSeq, kSeq}).contiguous();
  expect_forward_ok(hidden, square);
  expect_forward_ok(hidden, one);
  expect_forward_ok(hidden, batched);
  at::Tensor a = module->forward(hidden, square);
  EXPECT_TRUE(at::allclose(a, module->forward(hidden, one), 0, 0));
  EXPECT_TRUE(at::allclose(a, module->forward(hidden, batched), 0, 0));
}

// ---------------------------------------------------------------------------------------------
// Position ids

TEST_F(Rejections, PositionIdsFloat) {
  MlaForwardOptions o;
  o.position_ids = at::arange(kSeq, double_options);
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("position_ids must be an integer tensor"));
  EXPECT_THAT(msg, HasSubstr("dtype=float64"));
}

TEST_F(Rejections, PositionIdsBool) {
  MlaForwardOptions o;
  o.position_ids = bool_ones({kSeq});
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("position_ids must be an integer tensor"));
  EXPECT_THAT(msg, HasSubstr("dtype=bool"));
}

TEST_F(Rejections, PositionIdsWrongShape) {
  const std::vector<std::pair<std::vector<int64_t>, std::string>> bad = {
      {{kSeq + 1}, "position_ids.shape=[7]"},
      {{3, kSeq}, "position_ids.shape=[3, 6]"},
      {{kBatch, kSeq - 1}, "position_ids.shape=[2, 5]"},
      {{kBatch, 1, kSeq}, "position_ids.shape=[2, 1, 6]"},
  };
  for (const auto& [sizes, shown] : bad) {
    MlaForwardOptions o;
    o.position_ids = at::zeros(sizes, at::TensorOptions().dtype(at::kLong));
    const std::string msg = forward_error(hidden, o);
    EXPECT_THAT(msg, HasSubstr("position_ids must be [S] or [B|1, S]"));
    EXPECT_THAT(msg, HasSubstr(shown));
    EXPECT_THAT(msg, HasSubstr("B=2"));
    EXPECT_THAT(msg, HasSubstr("S=6"));
  }
}

TEST_F(Rejections, PositionIdsShapesAccepted) {
  const at::Tensor ids = at::arange(kSeq, at::TensorOptions().dtype(at::kLong));
  MlaForwardOptions flat, one, batched, int32;
  flat.position_ids = ids;
  one.position_ids = ids.unsqueeze(0);
  batched.position_ids = ids.unsqueeze(0).expand({kBatch, kSeq}).contiguous();
  int32.position_ids = ids.to(at::kInt);
  const at::Tensor reference = module->forward(hidden, {});  // default positions 0..S-1
  for (const MlaForwardOptions* o : {&flat, &one, &batched, &int32}) {
    EXPECT_TRUE(at::equal(module->forward(hidden, *o), reference));
  }
}

TEST_F(Rejections, NegativePositionIds) {
  MlaForwardOptions o;
  o.position_ids = at::arange(kSeq, at::TensorOptions().dtype(at::kLong)) - 1;
  const std::string msg = forward_error(hidden, o);
  EXPECT_THAT(msg, HasSubstr("position_ids must be >= 0"));
  EXPECT_THAT(msg, HasSubstr("min=-1"));
}

TEST_F(Rejections, PositionIdsConflictWithDocumentEnds) {
  MlaForwardOptions o;
  o.document_ends = std::vector<int64_t>{3, 6};
  o.position_ids = at::arange(kSeq, at::TensorOptions().dtype(at::kLong));  // not restarting at 3
  const std::string msg = forward_error(packed_hidden, o);
  EXPECT_THAT(msg, HasSubstr("position_ids disagree with the positions implied by document_ends"));
  EXPECT_THAT(msg, HasSubstr("document_ends=[3, 6]"));
}

TEST_F(Rejections, PositionIdsEqualToDocumentPositionsAccepted) {
  MlaForwardOptions derived;
  derived.document_ends = std::vector<int64_t>{3, 6};
  MlaForwardOptions explicit_ids = derived;
  explicit_ids.position_ids = long_tensor({0, 1, 2, 0, 1, 2});
  MlaForwardOptions explicit_2d = derived;
  explicit_2d.position_ids = long_tensor({0, 1, 2, 0, 1, 2}).unsqueeze(0);
  const at::Tensor reference = module->forward(packed_hidden, derived);
  EXPECT_TRUE(at::equal(module->forward(packed_hidden, explicit_ids), reference));
  EXPECT_TRUE(at::equal(module->forward(packed_hidden, explicit_2d), reference));
}

// ---------------------------------------------------------------------------------------------
// Latents fed to single_device_core

TEST_F(Rejections, LatentsAccepted) {
  const LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  const ResolvedForward resolved = MlaLayer::resolve(*module, hidden, {});
  at::Tensor out = MlaLayer::single_device_core(*module, latents, resolved);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{kBatch, kSeq, config.num_heads * config.v_head_dim}));
}

TEST_F(Rejections, LatentNot3D) {
  LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  latents.query_latent = latents.query_latent.reshape({kBatch * kSeq, 5});
  std::string msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("query_latent must be 3-D [B, S, rank]"));
  EXPECT_THAT(msg, HasSubstr("query_latent.shape=[12, 5]"));

  latents = MlaLayer::compute_latents(*module, hidden);
  latents.key_rope_raw = at::Tensor();
  msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("key_rope_raw must be 3-D [B, S, rank]"));
  EXPECT_THAT(msg, HasSubstr("key_rope_raw.shape=undefined"));
}

TEST_F(Rejections, LatentEmpty) {
  LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  latents.kv_latent = at::zeros({kBatch, 0, config.kv_lora_rank}, double_options);
  const std::string msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("kv_latent must not be empty"));
  EXPECT_THAT(msg, HasSubstr("kv_latent.shape=[2, 0, 6]"));
}

TEST_F(Rejections, LatentsMismatchedBatchOrSeq) {
  LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  latents.kv_latent = latents.kv_latent.narrow(1, 0, kSeq - 1);
  std::string msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("latents must share batch and sequence dims"));
  EXPECT_THAT(msg, HasSubstr("query_latent.shape=[2, 6, 5]"));
  EXPECT_THAT(msg, HasSubstr("kv_latent.shape=[2, 5, 6]"));

  latents = MlaLayer::compute_latents(*module, hidden);
  latents.key_rope_raw = latents.key_rope_raw.narrow(0, 0, 1);
  msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("latents must share batch and sequence dims"));
  EXPECT_THAT(msg, HasSubstr("key_rope_raw.shape=[1, 6, 2]"));
}

TEST_F(Rejections, LatentsMismatchedDtype) {
  LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  latents.key_rope_raw = latents.key_rope_raw.to(at::kFloat);
  const std::string msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("latents must share one dtype"));
  EXPECT_THAT(msg, HasSubstr("query_latent.dtype=float64"));
  EXPECT_THAT(msg, HasSubstr("key_rope_raw.dtype=float32"));
}

TEST_F(Rejections, LatentWrongWidth) {
  LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  latents.kv_latent = at::zeros({kBatch, kSeq, config.kv_lora_rank + 1}, double_options);
  std::string msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("kv_latent has the wrong width"));
  EXPECT_THAT(msg, HasSubstr("width=7"));
  EXPECT_THAT(msg, HasSubstr("expected=6"));

  latents = MlaLayer::compute_latents(*module, hidden);
  latents.query_latent = at::zeros({kBatch, kSeq, config.hidden_size}, double_options);  // d, not Rq
  msg = core_error(latents);
  EXPECT_THAT(msg, HasSubstr("query_latent has the wrong width"));
  EXPECT_THAT(msg, HasSubstr("width=12"));
  EXPECT_THAT(msg, HasSubstr("expected=5"));
}

// ---------------------------------------------------------------------------------------------
// expand_key_value head range

TEST_F(Rejections, ExpandKeyValueHeadRangeOutOfBounds) {
  const LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  const struct {
    int64_t begin, end;
  } bad[] = {{0, 5}, {-1, 2}, {2, 2}, {3, 1}, {4, 5}};
  for (const auto& range : bad) {
    const std::string msg =
        error_of([&] { MlaLayer::expand_key_value(*module, latents.kv_latent, latents.key_rope_raw, range.begin, range.end); });
    EXPECT_THAT(msg, HasSubstr("head range must lie inside kv_b_proj's heads"));
    EXPECT_THAT(msg, HasSubstr("head_begin=" + std::to_string(range.begin)));
    EXPECT_THAT(msg, HasSubstr("head_end=" + std::to_string(range.end)));
    EXPECT_THAT(msg, HasSubstr("heads=4"));
  }
}

TEST_F(Rejections, ExpandKeyValueHeadRangeInsideAccepted) {
  const LocalLatents latents = MlaLayer::compute_latents(*module, hidden);
  auto [key, value] = MlaLayer::expand_key_value(*module, latents.kv_latent, latents.key_rope_raw, 1, 3);
  EXPECT_EQ(key.sizes(), (std::vector<int64_t>{kBatch, kSeq, 2, config.qk_head_dim()}));
  EXPECT_EQ(value.sizes(), (std::vector<int64_t>{kBatch, kSeq, 2, config.v_head_dim}));
  auto [all_key, all_value] = MlaLayer::expand_key_value(*module, latents.kv_latent, latents.key_rope_raw, 0, 4);
  EXPECT_TRUE(at::allclose(key, all_key.narrow(2, 1, 2)));
  EXPECT_TRUE(at::allclose(value, all_value.narrow(2, 1, 2)));
}

}  // namespace
}  // namespace mlacp
