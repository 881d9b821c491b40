// MlaConfig: the shape and numerics of one DeepSeek-style Multi-head Latent Attention layer.
// Glossary used everywhere in mlacp (docs/DESIGN.md §1):
//   d    hidden_size            H    num_heads
//   Rq   q_lora_rank (optional) Rkv  kv_lora_rank
//   Dn   qk_nope_head_dim       Dr   qk_rope_head_dim      Dqk = Dn + Dr
//   Dv   v_head_dim
// Owns: validation of the config on its own, presets, HuggingFace config.json reading/writing.
// Does not own: anything about ranks or parallel layout (that is the plan's).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mlacp {

enum class RopeLayout {
  half_split,   // rotate_half on [x1 | x2]
  interleaved,  // DeepSeek rope_interleave: de-interleave even/odd lanes, then half-split
};

// DeepSeek's YaRN rope scaling (HF rope_scaling with type "yarn").
struct YarnScaling {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;  // 0 = no attention-scale correction
  bool operator==(const YarnScaling& other) const;
};

struct MlaConfig {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  std::optional<int64_t> q_lora_rank;  // none: the query is projected from the hidden state (q_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  double rms_norm_eps = 1e-6;
  // How the q/kv latent norms compute: false (DeepSeek's reference) in at least float32, a
  // float64 input staying float64; true (HuggingFace's DeepseekV3RMSNorm, set for modules
  // adopted from transformers) always in float32, scaled by the weight in the input's dtype.
  bool rms_norm_float32 = false;
  double rope_theta = 10000.0;
  RopeLayout rope_layout = RopeLayout::half_split;
  std::optional<YarnScaling> yarn;
  int64_t max_position_embeddings = 4096;
  bool attention_bias = false;   // HF meaning: biases on q_a_proj, kv_a_proj_with_mqa, o_proj
                                 // (and q_proj when there is no q latent)
  bool up_proj_bias = false;     // mlacp extension: biases on q_b_proj and kv_b_proj
  bool output_gate = false;      // gated attention: o * sigmoid(o_gate_proj(x)) before o_proj
  bool causal = true;            // default of the forward's is_causal
  double attention_dropout = 0.0;              // must be 0: mlacp computes exact attention
  std::optional<double> softmax_scale;         // explicit scaling: only checked, never recomputed

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Width of the query "latent" fed to the query up-projection: Rq, or d without q latent.
  int64_t query_latent_dim() const { return q_lora_rank ? *q_lora_rank : hidden_size; }
  // The softmax scaling of docs/DESIGN.md §1: softmax_scale if given, else Dqk^-0.5 times the YaRN
  // mscale(factor, mscale_all_dim)^2 when YaRN with mscale_all_dim is configured.
  double scaling() const;
  // Multiplier applied to cos/sin by YaRN: mscale(factor, mscale) / mscale(factor, mscale_all_dim).
  double rope_magnitude_scale() const;
  // Throws mlacp::Error naming the first broken rule.
  void validate() const;
  bool operator==(const MlaConfig& other) const;
};

// YaRN's attention-magnitude correction: 1 if factor <= 1 else 0.1*mscale*ln(factor) + 1.
double yarn_mscale(double factor, double mscale);

// Presets: "deepseek-v3", "deepseek-v2-lite", "tiny" (odd sizes on purpose).
MlaConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

// HuggingFace-style config.json (DeepSeek-V3 field names). Unknown or contradictory fields are
// errors. Model fields outside attention (vocab_size, MoE sizes, ...) are recognised and ignored.
// mlacp's own extensions live under the "mlacp" key.
// Both HF spellings are read: transformers 5's `rope_parameters` {rope_type "default"|"yarn",
// rope_theta, YaRN fields} and `dtype`, and the older `rope_scaling` + top-level `rope_theta` and
// `torch_dtype`. Where both spellings are present they must agree (else an error naming both);
// a field that changes the math is never ignored.
MlaConfig parse_config_json(const std::string& json_text);
MlaConfig load_config_file(const std::string& path);

// What a config.json says beyond the attention layer, for checkpoint readers.
struct HfConfig {
  MlaConfig attention;
  std::optional<int64_t> num_hidden_layers;  // when the file has it (>= 1)
  std::optional<std::string> dtype;          // `dtype` / `torch_dtype` ("bfloat16", "float32", ...), when given
};
HfConfig parse_hf_config_json(const std::string& json_text);
HfConfig load_hf_config_file(const std::string& path);
std::string config_to_json(const MlaConfig& config, int indent = 2);

std::string rope_layout_name(RopeLayout layout);
RopeLayout parse_rope_layout(const std::string& name);

}  // namespace mlacp
