// Training from a HuggingFace checkpoint (train/hf_decoder.h): the decoder's parameters map to HF
// names and shapes; loading a dense DeepSeek-V3 checkpoint gives the written values and the loss
// of a model holding them; the trainer starts every rank from it; broken checkpoints and
// conflicting settings are one clear mlacp::Error each, before any data is read.
#include <cmath>
#include <functional>
#include <map>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "mlacp/checkpoint.h"
#include "mlacp/config.h"
#include "mlacp/errors.h"
#include "support/hf_test_checkpoint.h"
#include "train/hf_decoder.h"
#include "train_support.h"

namespace mlacp::train {
namespace {

using ::testing::HasSubstr;
using mlacp::test::RawTensor;

constexpr uint64_t kWeightsSeed = 11;

std::vector<RawTensor> decoder_tensors(int64_t vocab = 256) {
  const MlaConfig attention = parse_config_json(mlacp::test::hf_test_decoder_config_json(vocab));
  return mlacp::test::hf_test_decoder_tensors(attention, mlacp::test::kHfTestDecoderLayers,
                                              mlacp::test::kHfTestDecoderIntermediate, vocab, kWeightsSeed,
                                              at::kBFloat16);
}

void write_checkpoint(const std::string& folder, const std::vector<RawTensor>& tensors, int64_t vocab = 256,
                      bool tie = false) {
  mlacp::test::write_hf_checkpoint(folder, mlacp::test::hf_test_decoder_config_json(vocab, tie), tensors, 2);
}

at::Tensor value_of(const RawTensor& raw) {  // the written tensor (BF16 or F32)
  EXPECT_TRUE(raw.dtype == "BF16" || raw.dtype == "F32") << raw.name;
  const at::ScalarType dtype = raw.dtype == "BF16" ? at::kBFloat16 : at::kFloat;
  return at::from_blob(const_cast<char*>(raw.bytes.data()), raw.shape, at::TensorOptions().dtype(dtype)).clone();
}

// Mean next-token cross-entropy of `model` on a fixed batch [2, 24].
double fixed_batch_loss(DecoderLm& model) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(99);
  const at::Tensor tokens = at::randint(0, 256, {2, 25}, generator, at::TensorOptions().dtype(at::kLong));
  const at::Tensor logits = model->forward(tokens.narrow(1, 0, 24), {{}, {}});  // [2, 24, 256]
  return at::cross_entropy_loss(logits.reshape({-1, 256}).to(at::kDouble), tokens.narrow(1, 1, 24).reshape({-1}))
      .item<double>();
}

TEST(HfDecoder, ParameterShapesAndHfNamesMatchTheDecoder) {
  DecoderConfig no_q_latent = decoder_preset("test");
  no_q_latent.attention.q_lora_rank.reset();
  no_q_latent.attention.attention_bias = true;
  for (const DecoderConfig& config : {decoder_preset("test"), decoder_preset("small"), no_q_latent}) {
    DecoderLm model(config, at::kFloat, 0);
    const auto shapes = decoder_parameter_shapes(config);
    const auto parameters = model->named_parameters();
    ASSERT_EQ(shapes.size(), parameters.size());
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(shapes[i].first, parameters[i].key());
      EXPECT_EQ(shapes[i].second, parameters[i].value().sizes().vec()) << shapes[i].first;
    }
  }
  EXPECT_EQ(hf_tensor_name("embed_tokens.weight"), "model.embed_tokens.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.input_layernorm.weight"), "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(hf_tensor_name("layers.1.self_attn.kv_b_proj.weight"), "model.layers.1.self_attn.kv_b_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.post_attention_layernorm.weight"),
            "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(hf_tensor_name("layers.1.gate_proj.weight"), "model.layers.1.mlp.gate_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.12.up_proj.weight"), "model.layers.12.mlp.up_proj.weight");
  EXPECT_EQ(hf_tensor_name("layers.0.down_proj.weight"), "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(hf_tensor_name("norm.weight"), "model.norm.weight");
  EXPECT_EQ(hf_tensor_name("lm_head.weight"), "lm_head.weight");
}

TEST(HfDecoder, LoadingGivesTheWrittenValuesAndTheirLoss) {
  test::TempDir dir("hf-load");
  std::vector<RawTensor> tensors = decoder_tensors();
  const std::string rotary = "model.layers.0.self_attn.rotary_emb.inv_freq";  // ignored (recomputed)
  tensors.push_back(mlacp::test::raw_tensor(rotary, at::ones({2})));
  write_checkpoint(dir.path(), tensors);
  std::map<std::string, at::Tensor> written;
  for (const RawTensor& t : tensors) written[t.name] = value_of(t);

  const DecoderConfig config = load_hf_decoder_config(dir.path());
  EXPECT_EQ(config.num_layers, 2);
  EXPECT_EQ(config.intermediate_size, 64);
  EXPECT_EQ(config.vocab_size, 256);
  EXPECT_EQ(config.attention.hidden_size, 32);
  EXPECT_EQ(config.attention.q_lora_rank, 16);
  EXPECT_EQ(config.attention.rope_layout, RopeLayout::interleaved) << "the config's rope_interleave";
  const HfCheckpoint checkpoint = open_hf_checkpoint(dir.path());
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    DecoderLm model(config, dtype, 3);
    const double random_loss = fixed_batch_loss(model);
    const HfDecoderInit init = load_hf_decoder_checkpoint(model, checkpoint);
    const auto parameters = model->named_parameters();
    EXPECT_EQ(init.tensors, static_cast<int64_t>(parameters.size()));
    EXPECT_EQ(init.tensors, static_cast<int64_t>(tensors.size()) - 1);
    EXPECT_EQ(init.layers, 2);
    EXPECT_EQ(init.ignored, std::vector<std::string>{rotary});
    EXPECT_EQ(init.describe(), "initialised from " + dir.path() + ": 27 tensors, 2 layers (ignored 1 rotary table)");
    for (const auto& item : parameters) {
      const at::Tensor& p = item.value();
      EXPECT_EQ(p.scalar_type(), dtype) << item.key();
      EXPECT_TRUE(p.requires_grad()) << item.key();
      EXPECT_TRUE(at::equal(p, written.at(hf_tensor_name(item.key())).to(dtype))) << item.key();
    }
    DecoderLm direct(config, dtype, 4);  // the same values, set by hand
    {
      at::NoGradGuard no_grad;
      for (auto& item : direct->named_parameters()) item.value().copy_(written.at(hf_tensor_name(item.key())));
    }
    const double loaded_loss = fixed_batch_loss(model);
    EXPECT_EQ(loaded_loss, fixed_batch_loss(direct));
    EXPECT_GT(std::abs(loaded_loss - random_loss), 1e-3) << "the checkpoint replaced the random draw";
    EXPECT_TRUE(std::isfinite(loaded_loss));
  }
}

// ---- rejections ------------------------------------------------------------------------------

void expect_error(const std::function<void()>& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "expected mlacp::Error containing " << parts.front();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("mlacp: "));
    for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

// The TrainConfig of `mlacp train --hf-checkpoint folder`, with a corpus that does not exist: each
// checkpoint error must come before any data is read.
TrainConfig from_checkpoint(const std::string& folder, bool model_from_file = true) {
  TrainConfig c = test::small_config(at::kFloat, 2);
  if (model_from_file) c.model = load_hf_decoder_config(folder);
  c.hf_checkpoint = folder;
  c.corpus_path = "/nonexistent/corpus";
  return c;
}

void expect_rejected(const std::string& folder, const std::vector<std::string>& parts) {
  TrainConfig c = from_checkpoint(folder, /*model_from_file=*/false);
  try {
    c.model = load_hf_decoder_config(folder);
  } catch (const Error&) {  // prepare_training must give the same error
  }
  expect_error([&] { prepare_training(c, 1); }, parts);
}

std::vector<RawTensor> without(std::vector<RawTensor> tensors, const std::string& prefix) {
  std::vector<RawTensor> kept;
  for (auto& t : tensors)
    if (t.name.rfind(prefix, 0) != 0) kept.push_back(std::move(t));
  return kept;
}

TEST(HfDecoderRejections, EachBrokenCheckpointIsOneClearError) {
  test::TempDir dir("hf-reject");
  const std::vector<RawTensor> good = decoder_tensors();

  // Another vocabulary: the config says so before any tensor is looked at.
  write_checkpoint(dir.file("vocab"), decoder_tensors(1000), 1000);
  const std::vector<std::string> vocab_error = {"mlacp train trains a byte-level model", "vocab_size=1000",
                                                "mlacp verify --checkpoint DIR"};
  expect_error([&] { load_hf_decoder_config(dir.file("vocab")); }, vocab_error);
  expect_rejected(dir.file("vocab"), vocab_error);

  // Layer 1 a MoE layer: router and experts instead of the dense MLP.
  std::vector<RawTensor> moe = without(good, "model.layers.1.mlp.");
  moe.push_back(mlacp::test::raw_tensor("model.layers.1.mlp.gate.weight", at::zeros({4, 32}, at::kBFloat16)));
  for (const char* w : {"gate_proj", "up_proj", "down_proj"}) {
    const std::vector<int64_t> shape =
        std::string(w) == "down_proj" ? std::vector<int64_t>{32, 16} : std::vector<int64_t>{16, 32};
    for (int e = 0; e < 4; ++e)
      moe.push_back(mlacp::test::raw_tensor("model.layers.1.mlp.experts." + std::to_string(e) + "." + w + ".weight",
                                            at::zeros(shape, at::kBFloat16)));
  }
  write_checkpoint(dir.file("moe"), moe);
  expect_rejected(dir.file("moe"), {"mlacp train's decoder is dense; layer 1 of the checkpoint is a MoE layer",
                                    "model.layers.1.mlp.experts.0.down_proj.weight",
                                    "mlacp verify --checkpoint " + dir.file("moe") + " --layer 1"});

  // A missing tensor.
  write_checkpoint(dir.file("missing"), without(good, "model.layers.0.mlp.up_proj.weight"));
  expect_rejected(dir.file("missing"),
                  {"missing from the checkpoint", "missing=[model.layers.0.mlp.up_proj.weight]"});

  // A wrong shape.
  std::vector<RawTensor> shape = without(good, "model.layers.1.mlp.down_proj.weight");
  shape.push_back(mlacp::test::raw_tensor("model.layers.1.mlp.down_proj.weight", at::zeros({32, 63}, at::kBFloat16)));
  write_checkpoint(dir.file("shape"), shape);
  expect_rejected(dir.file("shape"), {"shape does not match the decoder's parameter",
                                      "tensor=model.layers.1.mlp.down_proj.weight", "shape=[32, 63]",
                                      "expected=[32, 64]"});

  // A tensor no parameter uses, and a layer the config does not count.
  std::vector<RawTensor> unused = good;
  unused.push_back(mlacp::test::raw_tensor("model.layers.0.mlp.gate_proj.bias", at::zeros({64}, at::kBFloat16)));
  write_checkpoint(dir.file("unused"), unused);
  expect_rejected(dir.file("unused"), {"has no parameter for", "model.layers.0.mlp.gate_proj.bias"});
  std::vector<RawTensor> beyond = good;
  beyond.push_back(mlacp::test::raw_tensor("model.layers.2.input_layernorm.weight", at::ones({32}, at::kBFloat16)));
  write_checkpoint(dir.file("beyond"), beyond);
  expect_rejected(dir.file("beyond"), {"layers the decoder does not have", "num_hidden_layers=2",
                                       "model.layers.2.input_layernorm.weight"});

  // fp8 weights: rejected from the header, with the way out.
  std::vector<RawTensor> fp8 = good;
  for (auto& t : fp8) {
    if (t.name != "model.layers.0.self_attn.kv_b_proj.weight") continue;
    t.dtype = "F8_E4M3";
    t.bytes.resize(t.bytes.size() / 2);
  }
  write_checkpoint(dir.file("fp8"), fp8);
  expect_rejected(dir.file("fp8"), {"fp8 weights are not supported", "dequantise"});

  // An integer tensor where a parameter belongs.
  std::vector<RawTensor> integer = without(good, "model.norm.weight");
  integer.push_back(mlacp::test::raw_tensor("model.norm.weight", at::ones({32}, at::kLong)));
  write_checkpoint(dir.file("integer"), integer);
  expect_rejected(dir.file("integer"), {"must be stored as floating point", "dtype=I64"});

  // Tied embeddings: the decoder has its own lm_head.
  write_checkpoint(dir.file("tied"), without(good, "lm_head."), 256, /*tie=*/true);
  expect_rejected(dir.file("tied"), {"tie_word_embeddings is true", "untie the checkpoint"});

  // Config fields the decoder cannot follow, or needs.
  const auto write_config = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(mlacp::test::hf_test_decoder_config_json());
    edit(j);
    mlacp::test::write_hf_checkpoint(dir.file(name), j.dump(2), good, 1);
    return dir.file(name);
  };
  expect_rejected(write_config("gelu", [](nlohmann::json& j) { j["hidden_act"] = "gelu"; }),
                  {"hidden_act must be \"silu\"", "hidden_act=\"gelu\""});
  expect_rejected(write_config("mlp-bias", [](nlohmann::json& j) { j["mlp_bias"] = true; }),
                  {"mlp_bias must be false"});
  expect_rejected(write_config("no-layers", [](nlohmann::json& j) { j.erase("num_hidden_layers"); }),
                  {"config.json must give num_hidden_layers"});

  // Not a checkpoint folder.
  expect_rejected(dir.file("nothing"), {"the checkpoint must be a folder"});
}

TEST(HfDecoderRejections, ConflictingTrainSettings) {
  test::TempDir dir("hf-conflict");
  write_checkpoint(dir.path(), decoder_tensors());
  TrainConfig resume = from_checkpoint(dir.path());
  resume.resume = true;
  resume.checkpoint_dir = dir.file("ckpt");
  expect_error([&] { prepare_training(resume, 1); },
               {"cannot go with --resume", "--config " + dir.file("config.json") + " --checkpoint DIR --resume"});
  TrainConfig preset = from_checkpoint(dir.path());
  preset.model = decoder_preset("test");  // the same sizes, another rope layout
  expect_error([&] { prepare_training(preset, 1); },
               {"the model config must be the HuggingFace checkpoint's", "differs_in=the attention's rope"});
  TrainConfig layers = from_checkpoint(dir.path());
  layers.model.num_layers = 1;
  expect_error([&] { prepare_training(layers, 1); }, {"the model config must be the HuggingFace checkpoint's"});
  // A good checkpoint passes its checks; the missing corpus is then the first error.
  expect_error([&] { prepare_training(from_checkpoint(dir.path()), 1); }, {"the corpus path must exist"});
}

// ---- training ----------------------------------------------------------------------------------

TEST(TrainHfCheckpoint, EveryRankStartsFromTheCheckpoint) {
  test::TempDir dir("hf-train");
  const std::vector<RawTensor> tensors = decoder_tensors();
  write_checkpoint(dir.path(), tensors);
  TrainConfig cp = test::small_config(at::kDouble, 3, {1, 2, 1, 0});
  cp.model = load_hf_decoder_config(dir.path());
  cp.hf_checkpoint = dir.path();
  ASSERT_TRUE(test::run_training(cp, dir.file("cp.pt")));
  TrainConfig single = cp;
  single.mesh = {1, 1, 1, 0};
  ASSERT_TRUE(test::run_training(single, dir.file("single.pt")));
  TrainConfig scratch = single;
  scratch.hf_checkpoint.clear();
  ASSERT_TRUE(test::run_training(scratch, dir.file("scratch.pt")));
  const test::RunResult a = test::load_result(dir.file("cp.pt")), b = test::load_result(dir.file("single.pt")),
                        c = test::load_result(dir.file("scratch.pt"));
  ASSERT_EQ(a.losses.size(), 3u);
  EXPECT_LE(test::max_relative_loss_error(a.losses, b.losses), 1e-9) << "cp=2 follows the single-process run";
  EXPECT_GT(std::abs(b.losses.front() - c.losses.front()), 1e-3) << "the checkpoint, not the seed, decides";

  // Step 1's loss is the loss of a model holding the written values on the first batch.
  DecoderLm direct(cp.model, at::kDouble, 0);
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> written;
    for (const RawTensor& t : tensors) written[t.name] = value_of(t);
    for (auto& item : direct->named_parameters()) item.value().copy_(written.at(hf_tensor_name(item.key())));
  }
  const PackedCorpus corpus(load_corpus(single.corpus_path), single.seq_len);
  BatchSampler sampler(corpus, single.batch, single.seed);
  const GlobalBatch batch = sampler.next();
  at::NoGradGuard no_grad;
  const at::Tensor logits = direct->forward(batch.tokens, batch.document_ends);
  const double expected = at::cross_entropy_loss(logits.reshape({-1, 256}), batch.labels.reshape({-1}), {},
                                                 at::Reduction::Sum, kIgnoreLabel)
                              .item<double>() /
                          static_cast<double>(batch.label_count);
  EXPECT_NEAR(b.losses.front(), expected, 1e-12 * expected);
}

}  // namespace
}  // namespace mlacp::train
