// Initialising mlacp train's decoder (train/model.h) from a HuggingFace DeepSeek-V3-style
// checkpoint folder (mlacp/checkpoint.h: config.json + model.safetensors or shards). The
// decoder has exactly the structure of a dense DeepSeek-V3 decoder; its parameters map to HF
// tensor names as
//
//   embed_tokens.weight                       model.embed_tokens.weight
//   layers.N.input_layernorm.weight           model.layers.N.input_layernorm.weight
//   layers.N.self_attn.<p>                    model.layers.N.self_attn.<p>   (MlaAttention's names)
//   layers.N.post_attention_layernorm.weight  model.layers.N.post_attention_layernorm.weight
//   layers.N.{gate,up,down}_proj.weight       model.layers.N.mlp.{gate,up,down}_proj.weight
//   norm.weight                               model.norm.weight
//   lm_head.weight                            lm_head.weight
//
// Every parameter must be in the checkpoint with its shape; every other tensor is an error
// (MoE layers, layers beyond num_hidden_layers, unused tensors such as MLP biases) except the
// rotary tables HF recomputes from the config, which are ignored: any tensor whose name has a
// "rotary_emb" component or ends in "inv_freq". Owns: the name map, the checks, the copy.
// Does not own: reading safetensors (mlacp/checkpoint.h), when the model is built (trainer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlacp/checkpoint.h"
#include "train/model.h"

namespace mlacp::train {

// The HF tensor name of a DecoderLm parameter (table above).
std::string hf_tensor_name(const std::string& parameter);

// FOLDER/config.json as a DecoderConfig (load_decoder_config: the attention fields, vocab_size
// 256) with the rules of a checkpoint to train from: num_hidden_layers and intermediate_size
// given, tie_word_embeddings false (the decoder has its own lm_head), hidden_act "silu" (SwiGLU)
// and mlp_bias false when given. Throws mlacp::Error naming the file, the field and the way out.
DecoderConfig load_hf_decoder_config(const std::string& folder);

// What a check or a load found.
struct HfDecoderInit {
  std::string folder;
  int64_t tensors = 0;               // parameters found (and, after a load, copied)
  int64_t layers = 0;
  std::vector<std::string> ignored;  // rotary tables (sorted)
  // "initialised from DIR: N tensors, L layers" (+ the ignored count when there are any)
  std::string describe() const;
};

// Checks, without reading tensor data, that `checkpoint` holds exactly the parameters of a
// DecoderLm built from `config` (decoder_parameter_shapes) under their HF names, with their
// shapes, in a readable floating dtype; in this order, each an mlacp::Error: MoE tensors
// (mlp.experts.*, mlp.gate.*, mlp.shared_experts.*), tensors of layers the decoder does not have,
// missing parameters, unused tensors, unreadable dtypes, wrong shapes.
HfDecoderInit check_hf_decoder_checkpoint(const HfCheckpoint& checkpoint, const DecoderConfig& config);

// Checks as above against model->config(), then copies every tensor into its parameter (no_grad,
// converted to the parameter's dtype). Load before parallelize() (TP sharding).
HfDecoderInit load_hf_decoder_checkpoint(DecoderLm& model, const HfCheckpoint& checkpoint);

}  // namespace mlacp::train
