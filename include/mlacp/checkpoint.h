// HuggingFace checkpoints: a folder with config.json and the weights as safetensors, either one
// model.safetensors or shards model-0000X-of-0000N.safetensors listed by
// model.safetensors.index.json (weight_map: tensor name -> shard file).
//
//   mlacp::HfCheckpoint ckpt = mlacp::open_hf_checkpoint("DeepSeek-V3-bf16");
//   mlacp::MlaAttention attn(ckpt.config());
//   ckpt.load_attention_layer(attn, /*layer=*/0);   // model.layers.0.self_attn.* -> attn's parameters
//
// Opening reads config.json (mlacp::parse_hf_config_json) and every safetensors header, and checks
// them (header length, JSON, offsets inside the file and consistent with shape x dtype, the index
// against the shards); tensor data is read only when asked, with plain file I/O. Stored dtypes read:
// F16, BF16, F32, F64 (and integer ones); fp8 weights (F8_E4M3 / F8_E5M2, DeepSeek-V3's release
// with weight_scale_inv block scales) are rejected with the way out (dequantise to bf16 first).
// Every rejection is an mlacp::Error naming the file, the tensor and the rule.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mlacp/attention.h"
#include "mlacp/config.h"

namespace mlacp {

struct HfTensorInfo {
  std::string name;
  std::string file;          // path of the safetensors file holding it
  std::string dtype;         // as stored: "BF16", "F32", "F8_E4M3", ...
  std::vector<int64_t> shape;
};

class HfCheckpoint {
 public:
  const std::string& folder() const;
  const HfConfig& hf_config() const;  // config.json: attention config, num_hidden_layers, dtype
  const MlaConfig& config() const { return hf_config().attention; }
  std::vector<std::string> tensor_names() const;  // sorted
  bool has_tensor(const std::string& name) const;
  HfTensorInfo tensor_info(const std::string& name) const;  // throws mlacp::Error for an unknown name

  // One tensor, read as stored, then converted to `dtype` when given.
  at::Tensor read_tensor(const std::string& name, std::optional<at::ScalarType> dtype = std::nullopt) const;
  // Throws the mlacp::Error read_tensor would give for the tensor's stored dtype (fp8 and other
  // dtypes LibTorch cannot hold), without reading its data; an unknown name throws as tensor_info.
  void require_readable(const std::string& name) const;

  // HF name prefix of decoder layer `layer`'s attention: "model.layers.<layer>.self_attn.".
  static std::string attention_prefix(int64_t layer);

  // Checks, without reading tensor data, that layer `layer`'s attention tensors are exactly the
  // parameters of an MlaAttention built from config() (names and shapes) in a readable dtype.
  void check_attention_layer(int64_t layer) const;
  // The attention weights of layer `layer`, named as MlaAttention's parameters ("q_a_proj.weight",
  // ...; in mla_parameter_shapes(config()) order), checked as above, converted to `dtype` when given.
  std::vector<std::pair<std::string, at::Tensor>> read_attention_layer(
      int64_t layer, std::optional<at::ScalarType> dtype = std::nullopt) const;
  // Copies layer `layer`'s attention weights into `module` (no_grad). The module's parameters
  // (names and shapes, so its config) must match the checkpoint's tensors exactly; missing and
  // extra tensors are named. With `dtype` the module is first converted to it; otherwise each
  // weight is converted to its parameter's dtype. Load before TP sharding (shard_heads_for_tp,
  // parallelize with tp > 1).
  void load_attention_layer(MlaAttention& module, int64_t layer,
                            std::optional<at::ScalarType> dtype = std::nullopt) const;

  struct Impl;

 private:
  HfCheckpoint() = default;  // open_hf_checkpoint makes them
  friend HfCheckpoint open_hf_checkpoint(const std::string& folder);
  std::shared_ptr<const Impl> impl_;
};

// Opens and checks a checkpoint folder (see above). Throws mlacp::Error.
HfCheckpoint open_hf_checkpoint(const std::string& folder);

}  // namespace mlacp
