// Test helper: a small DeepSeek-style HuggingFace checkpoint (config.json in the transformers 5
// form + every tensor a decoder would hold, attention and otherwise), as raw tensors for
// tests/support/safetensors_writer.h. Also a dense decoder checkpoint with the shapes of mlacp
// train's "test" decoder preset and the byte vocabulary (hf_test_decoder_*), to train from.
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "mlacp/attention.h"
#include "support/safetensors_writer.h"

namespace mlacp::test {

// The attention shape of the test checkpoints: odd sizes, q latent, YaRN, interleaved rope.
inline std::string hf_test_config_json(int64_t layers = 2, bool attention_bias = false, bool q_latent = true) {
  nlohmann::json j = {
      {"architectures", {"DeepseekV3ForCausalLM"}},
      {"model_type", "deepseek_v3"},
      {"hidden_size", 16},
      {"num_attention_heads", 4},
      {"num_key_value_heads", 4},
      {"kv_lora_rank", 6},
      {"qk_nope_head_dim", 4},
      {"qk_rope_head_dim", 2},
      {"v_head_dim", 3},
      {"head_dim", 2},
      {"intermediate_size", 24},
      {"vocab_size", 32},
      {"rms_norm_eps", 1e-6},
      {"rope_interleave", true},
      {"max_position_embeddings", 256},
      {"rope_parameters",
       {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0}, {"original_max_position_embeddings", 64},
        {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}},
      {"attention_bias", attention_bias},
      {"attention_dropout", 0.0},
      {"dtype", "bfloat16"},
      {"transformers_version", "5.0.0"}};
  j["q_lora_rank"] = q_latent ? nlohmann::json(8) : nlohmann::json(nullptr);
  if (layers > 0) j["num_hidden_layers"] = layers;
  return j.dump(2);
}

// Random attention weights of one layer, named as MlaAttention's parameters, in `dtype`.
inline std::vector<std::pair<std::string, at::Tensor>> random_attention_weights(const MlaConfig& config, uint64_t seed,
                                                                                at::ScalarType dtype) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  MlaAttention shapes(config);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& item : shapes->named_parameters()) {
    const at::Tensor& p = item.value();
    at::Tensor v = at::randn(p.sizes(), generator, at::TensorOptions().dtype(at::kFloat));
    v = item.key().find("layernorm") != std::string::npos ? 1.0 + 0.2 * v
                                                           : v / std::sqrt(p.dim() == 2 ? double(p.size(1)) : 4.0);
    weights.emplace_back(item.key(), v.to(dtype));
  }
  return weights;
}

// A whole decoder's tensors in HF names: embed_tokens, per layer the attention weights of
// random_attention_weights(config, seed + layer) plus norms and MLP, the final norm and lm_head.
inline std::vector<RawTensor> hf_test_tensors(const MlaConfig& config, int64_t layers, uint64_t seed,
                                              at::ScalarType dtype) {
  const int64_t d = config.hidden_size;
  auto filler = [&](std::vector<int64_t> shape, uint64_t s) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(s);
    return at::randn(shape, g, at::TensorOptions().dtype(at::kFloat)).to(dtype);
  };
  std::vector<RawTensor> tensors;
  tensors.push_back(raw_tensor("model.embed_tokens.weight", filler({32, d}, seed + 1000)));
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    tensors.push_back(raw_tensor(p + "input_layernorm.weight", filler({d}, seed + 2000 + l)));
    for (const auto& [name, value] : random_attention_weights(config, seed + l, dtype))
      tensors.push_back(raw_tensor(p + "self_attn." + name, value));
    tensors.push_back(raw_tensor(p + "post_attention_layernorm.weight", filler({d}, seed + 3000 + l)));
    tensors.push_back(raw_tensor(p + "mlp.gate_proj.weight", filler({24, d}, seed + 4000 + l)));
    tensors.push_back(raw_tensor(p + "mlp.up_proj.weight", filler({24, d}, seed + 5000 + l)));
    tensors.push_back(raw_tensor(p + "mlp.down_proj.weight", filler({d, 24}, seed + 6000 + l)));
  }
  tensors.push_back(raw_tensor("model.norm.weight", filler({d}, seed + 7000)));
  tensors.push_back(raw_tensor("lm_head.weight", filler({32, d}, seed + 8000)));
  return tensors;
}

// mlacp train's "test" decoder preset (d 32, 4 heads, Rq 16, Rkv 16, Dn 8, Dr 4, Dv 8, 2 layers,
// SwiGLU 64) as a dense DeepSeek-V3 config.json in the transformers 5 form, vocab_size `vocab`
// (the byte tokenizer's 256 unless a test wants another), rope "default", interleaved.
constexpr int64_t kHfTestDecoderLayers = 2;
constexpr int64_t kHfTestDecoderIntermediate = 64;
inline std::string hf_test_decoder_config_json(int64_t vocab = 256, bool tie_word_embeddings = false) {
  const nlohmann::json j = {
      {"architectures", {"DeepseekV3ForCausalLM"}},
      {"model_type", "deepseek_v3"},
      {"hidden_size", 32},
      {"num_attention_heads", 4},
      {"num_key_value_heads", 4},
      {"q_lora_rank", 16},
      {"kv_lora_rank", 16},
      {"qk_nope_head_dim", 8},
      {"qk_rope_head_dim", 4},
      {"v_head_dim", 8},
      {"head_dim", 4},
      {"num_hidden_layers", kHfTestDecoderLayers},
      {"intermediate_size", kHfTestDecoderIntermediate},
      {"n_routed_experts", nullptr},
      {"hidden_act", "silu"},
      {"vocab_size", vocab},
      {"tie_word_embeddings", tie_word_embeddings},
      {"rms_norm_eps", 1e-6},
      {"rope_interleave", true},
      {"max_position_embeddings", 4096},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"dtype", "bfloat16"},
      {"transformers_version", "5.0.0"}};
  return j.dump(2);
}

// Every tensor of that dense decoder in HF names, in `dtype`, scaled like a trained model's
// (norms near 1, matrices ~ 1/sqrt(fan-in)) so that a training from them is well behaved.
inline std::vector<RawTensor> hf_test_decoder_tensors(const MlaConfig& config, int64_t layers, int64_t intermediate,
                                                      int64_t vocab, uint64_t seed, at::ScalarType dtype) {
  const int64_t d = config.hidden_size;
  auto draw = [&](std::vector<int64_t> shape, uint64_t s) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(s);
    return at::randn(shape, g, at::TensorOptions().dtype(at::kFloat));
  };
  auto matrix = [&](int64_t out, int64_t in, uint64_t s) { return (draw({out, in}, s) / std::sqrt(double(in))).to(dtype); };
  auto norm = [&](uint64_t s) { return (1.0 + 0.1 * draw({d}, s)).to(dtype); };
  std::vector<RawTensor> tensors;
  tensors.push_back(raw_tensor("model.embed_tokens.weight", draw({vocab, d}, seed + 1000).to(dtype)));
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    tensors.push_back(raw_tensor(p + "input_layernorm.weight", norm(seed + 2000 + l)));
    for (const auto& [name, value] : random_attention_weights(config, seed + l, dtype))
      tensors.push_back(raw_tensor(p + "self_attn." + name, value));
    tensors.push_back(raw_tensor(p + "post_attention_layernorm.weight", norm(seed + 3000 + l)));
    tensors.push_back(raw_tensor(p + "mlp.gate_proj.weight", matrix(intermediate, d, seed + 4000 + l)));
    tensors.push_back(raw_tensor(p + "mlp.up_proj.weight", matrix(intermediate, d, seed + 5000 + l)));
    tensors.push_back(raw_tensor(p + "mlp.down_proj.weight", matrix(d, intermediate, seed + 6000 + l)));
  }
  tensors.push_back(raw_tensor("model.norm.weight", norm(seed + 7000)));
  tensors.push_back(raw_tensor("lm_head.weight", matrix(vocab, d, seed + 8000)));
  return tensors;
}

}  // namespace mlacp::test
