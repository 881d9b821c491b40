// The decoder: deterministic initialisation, which gradients are summed over TP, packed documents
// that really are separate, config.json sizes.
#include <fstream>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "mlacp/errors.h"
#include "train/model.h"
#include "train_support.h"

namespace mlacp::train {
namespace {

using ::testing::HasSubstr;

TEST(DecoderLm, InitialisationDependsOnlyOnTheSeed) {
  const DecoderConfig config = decoder_preset("test");
  DecoderLm a(config, at::kFloat, 5), b(config, at::kFloat, 5), c(config, at::kFloat, 6), d(config, at::kDouble, 5);
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters(),
             pd = d->named_parameters();
  ASSERT_EQ(pa.size(), pd.size());
  bool any_differs = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::equal(pa[i].value(), pb[i].value())) << pa[i].key();
    EXPECT_TRUE(at::equal(pa[i].value().to(at::kDouble), pd[i].value())) << "float64 starts from float32's values";
    any_differs = any_differs || !at::equal(pa[i].value(), pc[i].value());
  }
  EXPECT_TRUE(any_differs);
}

TEST(DecoderLm, ParameterNamesAndTpReductionRule) {
  DecoderLm model(decoder_preset("test"), at::kFloat, 0);
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ::testing::Contains("embed_tokens.weight"));
  EXPECT_THAT(names, ::testing::Contains("layers.1.self_attn.kv_b_proj.weight"));
  EXPECT_THAT(names, ::testing::Contains("lm_head.weight"));
  // Not summed over TP: TP-sharded attention weights and everything outside attention.
  for (const char* name : {"layers.0.self_attn.q_b_proj.weight", "layers.0.self_attn.kv_b_proj.weight",
                           "layers.1.self_attn.o_proj.weight", "embed_tokens.weight", "layers.0.gate_proj.weight",
                           "layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight"})
    EXPECT_TRUE(DecoderLmImpl::skips_tp_reduction(name)) << name;
  // Summed over TP: TP-replicated attention parameters (their gradients are partial per TP rank).
  for (const char* name : {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight",
                           "layers.1.self_attn.kv_a_layernorm.weight", "layers.1.self_attn.q_a_layernorm.weight"})
    EXPECT_FALSE(DecoderLmImpl::skips_tp_reduction(name)) << name;
  EXPECT_TRUE(DecoderLmImpl::is_tp_split("layers.0.self_attn.o_proj.weight"));
  EXPECT_FALSE(DecoderLmImpl::is_tp_split("layers.0.down_proj.weight"));
}

TEST(DecoderLm, PackedDocumentsDoNotSeeEachOther) {
  DecoderLm model(decoder_preset("test"), at::kDouble, 1);
  at::Tensor tokens = at::randint(0, 256, {1, 24}, at::kLong);
  const std::vector<std::vector<int64_t>> ends{{10, 24}};
  const at::Tensor logits = model->forward(tokens, ends);  // [1, 24, 256]
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, 24, 256}));
  at::Tensor changed = tokens.clone();
  changed.narrow(1, 0, 10).fill_(65);  // rewrite document 0 only
  const at::Tensor again = model->forward(changed, ends);
  EXPECT_TRUE(at::allclose(again.narrow(1, 10, 14), logits.narrow(1, 10, 14), 0.0, 0.0)) << "document 1 unchanged";
  EXPECT_FALSE(at::allclose(again.narrow(1, 0, 10), logits.narrow(1, 0, 10)));
  // Document 1 alone, starting at position 0, gives the same logits (positions restart).
  const at::Tensor alone = model->forward(tokens.narrow(1, 10, 14), {{}});
  EXPECT_LT((alone - logits.narrow(1, 10, 14)).abs().max().item<double>(), 1e-12);
}

TEST(DecoderConfig, ReadsSizesFromConfigJson) {
  test::TempDir dir("config");
  const std::string sizes = R"({"hidden_size": 24, "num_attention_heads": 2, "q_lora_rank": 8,
    "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
    "num_hidden_layers": 3, "intermediate_size": 40)";
  std::ofstream(dir.file("config.json")) << sizes << R"(, "vocab_size": 256})";
  const DecoderConfig c = load_decoder_config(dir.file("config.json"));
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.intermediate_size, 40);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.attention.hidden_size, 24);
  std::ofstream(dir.file("no-vocab.json")) << sizes << "}";
  EXPECT_EQ(load_decoder_config(dir.file("no-vocab.json")).vocab_size, 256) << "the byte tokenizer's by default";
  EXPECT_THROW(decoder_preset("huge"), Error);
}

TEST(DecoderConfig, AnotherVocabularyIsAnError) {
  // It used to be trained silently with 256 tokens.
  test::TempDir dir("vocab");
  std::ofstream(dir.file("config.json")) << R"({"hidden_size": 24, "num_attention_heads": 2, "q_lora_rank": 8,
    "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "vocab_size": 129280})";
  try {
    load_decoder_config(dir.file("config.json"));
    FAIL() << "expected mlacp::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("mlacp train trains a byte-level model"));
    EXPECT_THAT(e.what(), HasSubstr("vocab_size=129280"));
    EXPECT_THAT(e.what(), HasSubstr(dir.file("config.json")));
    EXPECT_THAT(e.what(), HasSubstr("mlacp verify --checkpoint DIR"));
  }
}

}  // namespace
}  // namespace mlacp::train
