#include <cmath>

#include "mlacp/config.h"
#include "mlacp/errors.h"

namespace mlacp {

bool YarnScaling::operator==(const YarnScaling& o) const {
  return factor == o.factor && original_max_position_embeddings == o.original_max_position_embeddings &&
         beta_fast == o.beta_fast && beta_slow == o.beta_slow && mscale == o.mscale &&
         mscale_all_dim == o.mscale_all_dim;
}

bool MlaConfig::operator==(const MlaConfig& o) const {
  return hidden_size == o.hidden_size && num_heads == o.num_heads && q_lora_rank == o.q_lora_rank &&
         kv_lora_rank == o.kv_lora_rank && qk_nope_head_dim == o.qk_nope_head_dim &&
         qk_rope_head_dim == o.qk_rope_head_dim && v_head_dim == o.v_head_dim &&
         rms_norm_eps == o.rms_norm_eps && rms_norm_float32 == o.rms_norm_float32 && rope_theta == o.rope_theta && rope_layout == o.rope_layout &&
         yarn == o.yarn && max_position_embeddings == o.max_position_embeddings &&
         attention_bias == o.attention_bias && up_proj_bias == o.up_proj_bias &&
         output_gate == o.output_gate && causal == o.causal && attention_dropout == o.attention_dropout &&
         softmax_scale == o.softmax_scale;
}

double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

double MlaConfig::scaling() const {
  if (softmax_scale) return *softmax_scale;
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (yarn && yarn->mscale_all_dim != 0.0) {
    const double m = yarn_mscale(yarn->factor, yarn->mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

double MlaConfig::rope_magnitude_scale() const {
  if (!yarn) return 1.0;
  return yarn_mscale(yarn->factor, yarn->mscale) / yarn_mscale(yarn->factor, yarn->mscale_all_dim);
}

namespace {

constexpr const char* kWhat = "MLA config";

void require_positive(int64_t value, const char* name) {
  MLACP_REQUIRE(value > 0, kWhat, std::string(name) + " must be > 0", {got(name, value)},
          "set it from the model's config.json or a preset (`mlacp info` lists them)");
}

}  // namespace

void MlaConfig::validate() const {
  require_positive(hidden_size, "hidden_size");
  require_positive(num_heads, "num_heads");
  if (q_lora_rank) require_positive(*q_lora_rank, "q_lora_rank");
  require_positive(kv_lora_rank, "kv_lora_rank");
  require_positive(qk_nope_head_dim, "qk_nope_head_dim");
  require_positive(qk_rope_head_dim, "qk_rope_head_dim");
  require_positive(v_head_dim, "v_head_dim");
  MLACP_REQUIRE(qk_rope_head_dim % 2 == 0, kWhat, "qk_rope_head_dim must be even (RoPE rotates lane pairs)",
          {got("qk_rope_head_dim", qk_rope_head_dim)}, "use an even rope dim such as 64");
  MLACP_REQUIRE(std::isfinite(rms_norm_eps) && rms_norm_eps > 0, kWhat, "rms_norm_eps must be finite and > 0",
          {got("rms_norm_eps", rms_norm_eps)}, "DeepSeek uses 1e-6");
  MLACP_REQUIRE(std::isfinite(rope_theta) && rope_theta > 1.0, kWhat, "rope_theta must be finite and > 1",
          {got("rope_theta", rope_theta)}, "DeepSeek uses 10000");
  require_positive(max_position_embeddings, "max_position_embeddings");
  MLACP_REQUIRE(attention_dropout == 0.0, kWhat, "attention_dropout must be 0 (mlacp computes exact attention)",
          {got("attention_dropout", attention_dropout)}, "set attention_dropout to 0.0");
  if (softmax_scale) {
    MLACP_REQUIRE(std::isfinite(*softmax_scale) && *softmax_scale > 0, kWhat,
            "softmax_scale must be finite and > 0", {got("softmax_scale", *softmax_scale)},
            "omit it to use Dqk^-0.5 (times the YaRN mscale^2 when configured)");
  }
  if (yarn) {
    MLACP_REQUIRE(std::isfinite(yarn->factor) && yarn->factor >= 1.0, kWhat, "rope_scaling.factor must be >= 1",
            {got("factor", yarn->factor)}, "use factor 1 for no scaling, or drop rope_scaling");
    MLACP_REQUIRE(yarn->original_max_position_embeddings > 0, kWhat,
            "rope_scaling.original_max_position_embeddings must be > 0",
            {got("original_max_position_embeddings", yarn->original_max_position_embeddings)},
            "DeepSeek-V3 uses 4096");
    MLACP_REQUIRE(std::isfinite(yarn->beta_fast) && std::isfinite(yarn->beta_slow) && yarn->beta_fast > yarn->beta_slow &&
                yarn->beta_slow > 0,
            kWhat, "rope_scaling needs beta_fast > beta_slow > 0",
            {got("beta_fast", yarn->beta_fast), got("beta_slow", yarn->beta_slow)}, "DeepSeek uses 32 and 1");
    MLACP_REQUIRE(std::isfinite(yarn->mscale) && std::isfinite(yarn->mscale_all_dim), kWhat,
            "rope_scaling mscale values must be finite",
            {got("mscale", yarn->mscale), got("mscale_all_dim", yarn->mscale_all_dim)}, "DeepSeek-V3 uses 1.0");
  }
}

MlaConfig preset_config(const std::string& name) {
  MlaConfig c;
  if (name == "deepseek-v3") {
    c.hidden_size = 7168; c.num_heads = 128; c.q_lora_rank = 1536; c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128; c.qk_rope_head_dim = 64; c.v_head_dim = 128;
    c.rope_layout = RopeLayout::interleaved; c.max_position_embeddings = 163840;
    c.yarn = YarnScaling{40.0, 4096, 32.0, 1.0, 1.0, 1.0};
  } else if (name == "deepseek-v2-lite") {
    c.hidden_size = 2048; c.num_heads = 16; c.q_lora_rank = std::nullopt; c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128; c.qk_rope_head_dim = 64; c.v_head_dim = 128;
    c.rope_layout = RopeLayout::interleaved; c.max_position_embeddings = 163840;
    c.yarn = YarnScaling{40.0, 4096, 32.0, 1.0, 0.707, 0.707};
  } else if (name == "tiny") {
    // Odd on purpose: nothing divides anything by accident.
    c.hidden_size = 12; c.num_heads = 4; c.q_lora_rank = 5; c.kv_lora_rank = 6;
    c.qk_nope_head_dim = 3; c.qk_rope_head_dim = 2; c.v_head_dim = 4;
    c.max_position_embeddings = 4096;
  } else {
    throw Error("MLA preset", "unknown preset name", {got("preset", name)},
                "choose one of deepseek-v3, deepseek-v2-lite, tiny, or load a config.json");
  }
  c.validate();
  return c;
}

std::vector<std::string> preset_names() { return {"deepseek-v3", "deepseek-v2-lite", "tiny"}; }

std::string rope_layout_name(RopeLayout layout) {
  return layout == RopeLayout::interleaved ? "interleaved" : "half_split";
}

RopeLayout parse_rope_layout(const std::string& name) {
  if (name == "interleaved") return RopeLayout::interleaved;
  if (name == "half_split" || name == "half-split") return RopeLayout::half_split;
  throw Error("rope layout", "must be half_split or interleaved", {got("rope_layout", name)},
              "interleaved is DeepSeek's rope_interleave=true");
}

}  // namespace mlacp
