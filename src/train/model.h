// A small DeepSeek-style decoder-only language model around mlacp::MlaAttention:
//
//   tokens [B, S_l] -> embed_tokens -> N x { h += self_attn(input_layernorm(h))
//                                             h += mlp(post_attention_layernorm(h)) }   (SwiGLU)
//                   -> norm -> lm_head -> logits [B, S_l, V]
//
// With context parallelism every rank runs the model on its CP shard of the tokens; only the
// attention layers talk to other ranks (made parallel with parallelize()). Everything outside
// attention is per-token and identical on every TP rank.
// Owns: the decoder config and presets, deterministic initialisation, which gradients are summed
// over TP. Does not own: data, the optimizer, groups.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "mlacp/attention.h"
#include "mlacp/comm.h"
#include "mlacp/plan.h"
#include "mlacp/runtime.h"

namespace mlacp::train {

struct DecoderConfig {
  MlaConfig attention;            // hidden_size is the model width d
  int64_t vocab_size = 256;       // the byte tokenizer's
  int64_t num_layers = 2;
  int64_t intermediate_size = 0;  // SwiGLU width
  void validate() const;          // throws mlacp::Error naming the first broken rule
  std::string describe() const;   // one line with every size
  bool operator==(const DecoderConfig& other) const;  // every field, the attention's included
  bool operator!=(const DecoderConfig& other) const { return !(*this == other); }
};

// "small" (the default of `mlacp train`: d 64, 4 heads, Rq 32, Rkv 32, Dn 16, Dr 8, Dv 16,
// 2 layers, SwiGLU 192, vocab 256) and "test" (half as wide, for the test suite).
DecoderConfig decoder_preset(const std::string& name);
std::vector<std::string> decoder_preset_names();
// A HuggingFace-style config.json: the attention part through mlacp::load_config_file, plus
// num_hidden_layers and intermediate_size when present (defaults: 2 and 3*d). vocab_size, when
// present, must be the byte tokenizer's 256 (another value is an mlacp::Error: mlacp train
// trains a byte-level model).
DecoderConfig load_decoder_config(const std::string& path);

// The parameters a DecoderLm built from `config` registers, in named_parameters() order: name
// ("embed_tokens.weight", "layers.0.self_attn.q_a_proj.weight", ...) and shape. Computed from the
// config alone, without allocating the model (the checkpoint reader checks against it).
std::vector<std::pair<std::string, std::vector<int64_t>>> decoder_parameter_shapes(const DecoderConfig& config);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const DecoderConfig& config, const at::TensorOptions& options);
  // hidden [B, S_l, d]; one forward option set per batch row (packed rows need batch 1, so the
  // attention runs row by row) -> [B, S_l, d]
  at::Tensor forward(const at::Tensor& hidden, const std::vector<MlaForwardOptions>& row_options);

  RmsNorm input_layernorm{nullptr};
  MlaAttention self_attn{nullptr};
  RmsNorm post_attention_layernorm{nullptr};
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(DecoderLayer);

class DecoderLmImpl : public torch::nn::Module {
 public:
  // Parameters are drawn in float32 from a generator seeded with `seed` (the same on every rank),
  // then cast to `dtype`: float32 and float64 models start from the same values.
  DecoderLmImpl(const DecoderConfig& config, at::ScalarType dtype, uint64_t seed);

  // tokens [B, S_l] int64 (this rank's shard), document_ends per row (global; empty vector: one
  // unpacked causal sequence) -> logits [B, S_l, V]
  at::Tensor forward(const at::Tensor& tokens, const std::vector<std::vector<int64_t>>& document_ends);

  // Activation recomputation per decoder layer (train --recompute, docs/DESIGN.md §7): each
  // layer's forward runs without a graph and keeps only its input; its backward runs the layer
  // again with one (the same collectives, in the same order on every rank) and backpropagates
  // through that. The numbers are those of a plain step, to the bit.
  void set_recompute(bool on) { recompute_ = on; }

  // Makes every attention layer run with context parallelism (mlacp::parallelize: TP head
  // sharding, plan, validation, install; the first collective compares plan fingerprints).
  void parallelize(const ParallelGroups& groups, const CpOptions& options);

  // The predicate for mlacp::reduce_gradients: true when a gradient must NOT be summed over TP.
  // Attention parameters: MlaAttentionImpl::skips_tp_reduction (the others hold
  // partial gradients). Everything else (embedding, norms, MLP, head) is computed identically on
  // every TP rank, so its gradient is already whole: true.
  static bool skips_tp_reduction(const std::string& name);
  // Whether a parameter is split over TP ranks (counted once per TP rank in the global norm).
  static bool is_tp_split(const std::string& name);

  const DecoderConfig& config() const { return config_; }

  torch::nn::Embedding embed_tokens{nullptr};
  std::vector<DecoderLayer> layers;
  RmsNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  void initialise(uint64_t seed);
  DecoderConfig config_;
  bool recompute_ = false;
};
TORCH_MODULE(DecoderLm);

}  // namespace mlacp::train
