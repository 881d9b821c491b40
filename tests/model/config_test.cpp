// MlaConfig: presets, HuggingFace config.json reading/writing, validation and the softmax
// scaling closed form (docs/DESIGN.md §1). Every rejection is checked for its rule and offending value.
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <nlohmann/json.hpp>
#include <gtest/gtest.h>

#include "support/error_of.h"
#include "mlacp/config.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

using ::testing::HasSubstr;

using test::error_of;

// The real DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), verbatim apart from layout.
const char* const kDeepSeekV3ConfigJson = R"json({
  "architectures": [
    "DeepseekV3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"
  },
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [
      128,
      128
    ]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})json";

// A config.json built from fields given as raw JSON value text; an empty value drops the field.
// The defaults are the "tiny" preset's attention fields.
std::string tiny_json(const std::map<std::string, std::string>& overrides = {}) {
  std::map<std::string, std::string> fields = {
      {"hidden_size", "12"},      {"num_attention_heads", "4"}, {"q_lora_rank", "5"},
      {"kv_lora_rank", "6"},      {"qk_nope_head_dim", "3"},    {"qk_rope_head_dim", "2"},
      {"v_head_dim", "4"},        {"rope_interleave", "false"}, {"max_position_embeddings", "4096"}};
  for (const auto& [key, value] : overrides) fields[key] = value;
  std::string text = "{";
  bool first = true;
  for (const auto& [key, value] : fields) {
    if (value.empty()) continue;
    text += (first ? "\"" : ", \"") + key + "\": " + value;
    first = false;
  }
  return text + "}";
}

// ---------------------------------------------------------------------------------------------
// Round trips and the real DeepSeek-V3 config.json

TEST(ConfigJson, TinyJsonHelperParsesAsTinyPreset) {
  EXPECT_EQ(parse_config_json(tiny_json()), preset_config("tiny"));
}

TEST(ConfigJson, RoundTripDeepSeekV3) {
  const MlaConfig c = preset_config("deepseek-v3");
  EXPECT_EQ(parse_config_json(config_to_json(c)), c);
}

TEST(ConfigJson, RoundTripDeepSeekV2Lite) {
  const MlaConfig c = preset_config("deepseek-v2-lite");
  ASSERT_FALSE(c.q_lora_rank.has_value());
  EXPECT_EQ(parse_config_json(config_to_json(c)), c);
}

TEST(ConfigJson, RoundTripTiny) {
  const MlaConfig c = preset_config("tiny");
  EXPECT_EQ(parse_config_json(config_to_json(c)), c);
}

TEST(ConfigJson, RoundTripAllPresetsAndIndents) {
  for (const std::string& name : preset_names()) {
    const MlaConfig c = preset_config(name);
    EXPECT_EQ(parse_config_json(config_to_json(c, 2)), c) << name;
    EXPECT_EQ(parse_config_json(config_to_json(c, -1)), c) << name << " (compact)";
  }
}

TEST(ConfigJson, RoundTripMlacpExtensions) {
  MlaConfig c = preset_config("tiny");
  c.output_gate = true;
  c.causal = false;
  c.up_proj_bias = true;
  c.attention_bias = true;
  c.softmax_scale = 0.123456789012345678;  // not representable in few digits
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 50000.0;
  c.rope_layout = RopeLayout::interleaved;
  c.yarn = YarnScaling{4.0, 1024, 16.0, 2.0, 0.5, 0.0};
  EXPECT_EQ(parse_config_json(config_to_json(c)), c);
}

TEST(ConfigJson, RealDeepSeekV3ConfigMatchesPreset) {
  const MlaConfig parsed = parse_config_json(kDeepSeekV3ConfigJson);
  const MlaConfig preset = preset_config("deepseek-v3");
  EXPECT_EQ(parsed, preset);
  // Spelled out, so a failure says which field drifted.
  EXPECT_EQ(parsed.hidden_size, 7168);
  EXPECT_EQ(parsed.num_heads, 128);
  EXPECT_EQ(parsed.q_lora_rank, std::optional<int64_t>(1536));
  EXPECT_EQ(parsed.kv_lora_rank, 512);
  EXPECT_EQ(parsed.qk_nope_head_dim, 128);
  EXPECT_EQ(parsed.qk_rope_head_dim, 64);
  EXPECT_EQ(parsed.v_head_dim, 128);
  EXPECT_EQ(parsed.qk_head_dim(), 192);
  EXPECT_EQ(parsed.max_position_embeddings, 163840);
  // No rope_interleave field: DeepSeek's own modeling code always de-interleaves.
  EXPECT_EQ(parsed.rope_layout, RopeLayout::interleaved);
  ASSERT_TRUE(parsed.yarn.has_value());
  EXPECT_EQ(parsed.yarn->factor, 40.0);
  EXPECT_EQ(parsed.yarn->original_max_position_embeddings, 4096);
  EXPECT_EQ(parsed.yarn->beta_fast, 32.0);
  EXPECT_EQ(parsed.yarn->beta_slow, 1.0);
  EXPECT_EQ(parsed.yarn->mscale, 1.0);
  EXPECT_EQ(parsed.yarn->mscale_all_dim, 1.0);
  EXPECT_FALSE(parsed.attention_bias);
  EXPECT_EQ(parsed.attention_dropout, 0.0);
  EXPECT_FALSE(parsed.softmax_scale.has_value());
}

TEST(ConfigJson, ConfigWithoutRopeInterleaveParsesAsInterleaved) {
  EXPECT_EQ(parse_config_json(tiny_json({{"rope_interleave", ""}})).rope_layout, RopeLayout::interleaved);
  EXPECT_EQ(parse_config_json(tiny_json({{"rope_interleave", "true"}})).rope_layout, RopeLayout::interleaved);
  EXPECT_EQ(parse_config_json(tiny_json({{"rope_interleave", "false"}})).rope_layout, RopeLayout::half_split);
}

TEST(ConfigJson, ConsistentRedundantFieldsAreAccepted) {
  // num_key_value_heads == heads, qk_head_dim == Dn + Dr, head_dim == Dr (HF) or Dqk.
  EXPECT_EQ(parse_config_json(tiny_json({{"num_key_value_heads", "4"}, {"qk_head_dim", "5"}, {"head_dim", "2"}})),
            preset_config("tiny"));
  EXPECT_EQ(parse_config_json(tiny_json({{"head_dim", "5"}})), preset_config("tiny"));
  // rope_type alone (newer HF spelling), and type == rope_type.
  EXPECT_TRUE(parse_config_json(tiny_json({{"rope_scaling", R"({"rope_type": "yarn", "factor": 4})"}})).yarn);
  EXPECT_TRUE(
      parse_config_json(tiny_json({{"rope_scaling", R"({"type": "yarn", "rope_type": "yarn", "factor": 4})"}})).yarn);
  EXPECT_FALSE(parse_config_json(tiny_json({{"rope_scaling", "null"}})).yarn);
}

TEST(ConfigJson, LoadConfigFileReadsAFile) {
  const std::string path = ::testing::TempDir() + "mlacp_config_test_v3.json";
  {
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(kDeepSeekV3ConfigJson, f);
    std::fclose(f);
  }
  EXPECT_EQ(load_config_file(path), preset_config("deepseek-v3"));
  std::remove(path.c_str());
}

// ---------------------------------------------------------------------------------------------
// config.json rejections

TEST(ConfigJsonErrors, UnknownTopLevelField) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"hiden_size", "12"}})); });
  EXPECT_THAT(msg, HasSubstr("unknown field in the config"));
  EXPECT_THAT(msg, HasSubstr("field=hiden_size"));
}

TEST(ConfigJsonErrors, UnknownFieldInRopeScaling) {
  const std::string msg = error_of([] {
    parse_config_json(tiny_json({{"rope_scaling", R"({"type": "yarn", "factor": 4, "beta_fastest": 32})"}}));
  });
  EXPECT_THAT(msg, HasSubstr("unknown field in rope_scaling"));
  EXPECT_THAT(msg, HasSubstr("field=beta_fastest"));
}

TEST(ConfigJsonErrors, UnknownFieldUnderMlacp) {
  const std::string msg =
      error_of([] { parse_config_json(tiny_json({{"mlacp", R"({"output_gate": true, "gated": true})"}})); });
  EXPECT_THAT(msg, HasSubstr("unknown field in mlacp"));
  EXPECT_THAT(msg, HasSubstr("field=gated"));
}

TEST(ConfigJsonErrors, KeyValueHeadsDifferFromAttentionHeads) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"num_key_value_heads", "1"}})); });
  EXPECT_THAT(msg, HasSubstr("MLA needs num_key_value_heads == num_attention_heads"));
  EXPECT_THAT(msg, HasSubstr("num_key_value_heads=1"));
  EXPECT_THAT(msg, HasSubstr("num_attention_heads=4"));
}

TEST(ConfigJsonErrors, QkHeadDimContradictsNopePlusRope) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"qk_head_dim", "6"}})); });
  EXPECT_THAT(msg, HasSubstr("qk_head_dim must equal qk_nope_head_dim + qk_rope_head_dim"));
  EXPECT_THAT(msg, HasSubstr("qk_head_dim=6"));
  EXPECT_THAT(msg, HasSubstr("qk_nope_head_dim=3"));
  EXPECT_THAT(msg, HasSubstr("qk_rope_head_dim=2"));
}

TEST(ConfigJsonErrors, HeadDimContradicts) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"head_dim", "3"}})); });
  EXPECT_THAT(msg, HasSubstr("head_dim must equal qk_rope_head_dim"));
  EXPECT_THAT(msg, HasSubstr("head_dim=3"));
}

TEST(ConfigJsonErrors, RopeScalingTypeNotYarn) {
  const std::string msg =
      error_of([] { parse_config_json(tiny_json({{"rope_scaling", R"({"type": "linear", "factor": 4})"}})); });
  EXPECT_THAT(msg, HasSubstr("unsupported rope type"));
  EXPECT_THAT(msg, HasSubstr("rope_scaling.type=linear"));
  EXPECT_THAT(msg, HasSubstr("\"default\" (plain RoPE) and \"yarn\""));
}

TEST(ConfigJsonErrors, RopeScalingTypeAndRopeTypeDiffer) {
  const std::string msg = error_of([] {
    parse_config_json(tiny_json({{"rope_scaling", R"({"type": "yarn", "rope_type": "dynamic", "factor": 4})"}}));
  });
  EXPECT_THAT(msg, HasSubstr("rope_scaling.type and rope_scaling.rope_type differ"));
  EXPECT_THAT(msg, HasSubstr("type=\"yarn\""));
  EXPECT_THAT(msg, HasSubstr("rope_type=\"dynamic\""));
}

TEST(ConfigJsonErrors, BooleanFieldGivenAsString) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"attention_bias", "\"false\""}})); });
  EXPECT_THAT(msg, HasSubstr("field must be true or false"));
  EXPECT_THAT(msg, HasSubstr("field=attention_bias"));
  EXPECT_THAT(msg, HasSubstr("value=\"false\""));
}

TEST(ConfigJsonErrors, IntegerFieldGivenAsFraction) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"kv_lora_rank", "1.5"}})); });
  EXPECT_THAT(msg, HasSubstr("field must be an integer"));
  EXPECT_THAT(msg, HasSubstr("field=kv_lora_rank"));
  EXPECT_THAT(msg, HasSubstr("value=1.5"));
}

TEST(ConfigJsonErrors, MissingRequiredField) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"v_head_dim", ""}})); });
  EXPECT_THAT(msg, HasSubstr("required field is missing"));
  EXPECT_THAT(msg, HasSubstr("field=v_head_dim"));
}

TEST(ConfigJsonErrors, NonZeroAttentionDropout) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"attention_dropout", "0.1"}})); });
  EXPECT_THAT(msg, HasSubstr("attention_dropout must be 0"));
  EXPECT_THAT(msg, HasSubstr("attention_dropout=0.1"));
}

TEST(ConfigJsonErrors, InvalidJson) {
  const std::string msg = error_of([] { parse_config_json(R"({"hidden_size": 12,)"); });
  EXPECT_THAT(msg, HasSubstr("not valid JSON"));
  EXPECT_THAT(msg, HasSubstr("parser="));
}

TEST(ConfigJsonErrors, TopLevelNotAnObject) {
  const std::string msg = error_of([] { parse_config_json("[1, 2, 3]"); });
  EXPECT_THAT(msg, HasSubstr("top level must be an object"));
  EXPECT_THAT(msg, HasSubstr("type=array"));
}

TEST(ConfigJsonErrors, OddRopeHeadDim) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"qk_rope_head_dim", "3"}})); });
  EXPECT_THAT(msg, HasSubstr("qk_rope_head_dim must be even"));
  EXPECT_THAT(msg, HasSubstr("qk_rope_head_dim=3"));
}

TEST(ConfigJsonErrors, ZeroOrNegativeDimsInJson) {
  std::string msg = error_of([] { parse_config_json(tiny_json({{"hidden_size", "0"}})); });
  EXPECT_THAT(msg, HasSubstr("hidden_size must be > 0"));
  EXPECT_THAT(msg, HasSubstr("hidden_size=0"));
  msg = error_of([] { parse_config_json(tiny_json({{"kv_lora_rank", "-6"}})); });
  EXPECT_THAT(msg, HasSubstr("kv_lora_rank must be > 0"));
  EXPECT_THAT(msg, HasSubstr("kv_lora_rank=-6"));
}

TEST(ConfigJsonErrors, LoadConfigFileMissingPath) {
  const std::string path = "/nonexistent/mlacp/config.json";
  const std::string msg = error_of([&] { load_config_file(path); });
  EXPECT_THAT(msg, HasSubstr("cannot open file"));
  EXPECT_THAT(msg, HasSubstr("path=" + path));
}

// ---------------------------------------------------------------------------------------------
// MlaConfig::validate and presets

TEST(ConfigValidate, ZeroOrNegativeDims) {
  struct Case {
    const char* name;
    void (*set)(MlaConfig&, int64_t);
  };
  const Case cases[] = {
      {"hidden_size", [](MlaConfig& c, int64_t v) { c.hidden_size = v; }},
      {"num_heads", [](MlaConfig& c, int64_t v) { c.num_heads = v; }},
      {"q_lora_rank", [](MlaConfig& c, int64_t v) { c.q_lora_rank = v; }},
      {"kv_lora_rank", [](MlaConfig& c, int64_t v) { c.kv_lora_rank = v; }},
      {"qk_nope_head_dim", [](MlaConfig& c, int64_t v) { c.qk_nope_head_dim = v; }},
      {"qk_rope_head_dim", [](MlaConfig& c, int64_t v) { c.qk_rope_head_dim = v; }},
      {"v_head_dim", [](MlaConfig& c, int64_t v) { c.v_head_dim = v; }},
      {"max_position_embeddings", [](MlaConfig& c, int64_t v) { c.max_position_embeddings = v; }},
  };
  for (const Case& k : cases) {
    for (int64_t value : {int64_t{0}, int64_t{-2}}) {
      MlaConfig c = preset_config("tiny");
      k.set(c, value);
      const std::string msg = error_of([&] { c.validate(); });
      EXPECT_THAT(msg, HasSubstr(std::string(k.name) + " must be > 0")) << k.name << "=" << value;
      EXPECT_THAT(msg, HasSubstr(std::string(k.name) + "=" + std::to_string(value))) << k.name;
    }
  }
}

TEST(ConfigValidate, SoftmaxScaleMustBePositiveAndFinite) {
  for (double bad : {0.0, -0.5, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    MlaConfig c = preset_config("tiny");
    c.softmax_scale = bad;
    const std::string msg = error_of([&] { c.validate(); });
    EXPECT_THAT(msg, HasSubstr("softmax_scale must be finite and > 0")) << bad;
    std::ostringstream shown;
    shown << bad;
    EXPECT_THAT(msg, HasSubstr("softmax_scale=" + shown.str())) << bad;
  }
}

TEST(ConfigValidate, OddRopeHeadDim) {
  MlaConfig c = preset_config("tiny");
  c.qk_rope_head_dim = 5;
  const std::string msg = error_of([&] { c.validate(); });
  EXPECT_THAT(msg, HasSubstr("qk_rope_head_dim must be even"));
  EXPECT_THAT(msg, HasSubstr("qk_rope_head_dim=5"));
}

TEST(ConfigValidate, UnknownPresetName) {
  const std::string msg = error_of([] { preset_config("deepseek-v4"); });
  EXPECT_THAT(msg, HasSubstr("unknown preset name"));
  EXPECT_THAT(msg, HasSubstr("preset=deepseek-v4"));
}

TEST(ConfigValidate, AllPresetsValidate) {
  for (const std::string& name : preset_names()) EXPECT_NO_THROW(preset_config(name).validate()) << name;
}

// ---------------------------------------------------------------------------------------------
// Softmax scaling (docs/DESIGN.md §1)

TEST(ConfigScaling, DeepSeekV3YarnClosedForm) {
  const double m = 0.1 * std::log(40.0) + 1.0;
  const double expected = std::pow(192.0, -0.5) * m * m;
  const double actual = preset_config("deepseek-v3").scaling();
  EXPECT_LE(std::abs(actual - expected), 1e-15 * expected) << "actual=" << actual << " expected=" << expected;
}

TEST(ConfigScaling, ExplicitSoftmaxScaleReturnedUnchanged) {
  MlaConfig c = preset_config("deepseek-v3");
  c.softmax_scale = 0.0731234567891;
  EXPECT_EQ(c.scaling(), 0.0731234567891);
  MlaConfig t = preset_config("tiny");
  t.softmax_scale = 3.5;
  EXPECT_EQ(t.scaling(), 3.5);
}

TEST(ConfigScaling, WithoutYarnIsInverseSqrtQkHeadDim) {
  const MlaConfig tiny = preset_config("tiny");
  ASSERT_FALSE(tiny.yarn.has_value());
  EXPECT_DOUBLE_EQ(tiny.scaling(), 1.0 / std::sqrt(5.0));

  MlaConfig v3 = preset_config("deepseek-v3");
  v3.yarn.reset();
  EXPECT_DOUBLE_EQ(v3.scaling(), 1.0 / std::sqrt(192.0));

  // YaRN without mscale_all_dim applies no attention-scale correction.
  MlaConfig no_all_dim = preset_config("deepseek-v3");
  no_all_dim.yarn->mscale_all_dim = 0.0;
  EXPECT_DOUBLE_EQ(no_all_dim.scaling(), 1.0 / std::sqrt(192.0));
}

// Regressions found in review: each of these escaped as a non-mlacp error or a wrong value.
TEST(ConfigJsonErrors, NonStringRopeScalingTypeIsAnMlacpError) {
  const std::string msg = error_of([] {
    parse_config_json(tiny_json({{"rope_scaling", R"({"type": 5, "factor": 4})"}}));
  });
  EXPECT_THAT(msg, HasSubstr("rope_scaling.type must be a string"));
  EXPECT_THAT(msg, HasSubstr("type=5"));
}

TEST(ConfigJsonErrors, HugeUnsignedIntegerIsReportedAsGiven) {
  const std::string msg = error_of([] {
    parse_config_json(tiny_json({{"max_position_embeddings", "18446744073709551615"}}));
  });
  EXPECT_THAT(msg, HasSubstr("out of range"));
  EXPECT_THAT(msg, HasSubstr("18446744073709551615"));
}

TEST(ConfigJson, NullSoftmaxScaleMeansAbsent) {
  const MlaConfig c = parse_config_json(tiny_json({{"mlacp", R"({"softmax_scale": null})"}}));
  EXPECT_FALSE(c.softmax_scale.has_value());
}

// ---------------------------------------------------------------------------------------------
// transformers 5 spelling: rope_parameters and dtype (and the older rope_scaling/torch_dtype)

// DeepSeek-V3's config.json as transformers 5 writes it (DeepseekV3Config.to_json_string):
// rope_parameters instead of rope_scaling + rope_theta, dtype instead of torch_dtype, head_dim and
// qk_head_dim spelled out.
const char* const kDeepSeekV3Transformers5Json = R"json({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 0,
  "dtype": "bfloat16",
  "eos_token_id": 1,
  "first_k_dense_replace": 3,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_head_dim": 192,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "rms_norm_eps": 1e-06,
  "rope_interleave": true,
  "rope_parameters": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_type": "yarn"
  },
  "routed_scaling_factor": 2.5,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})json";

// The transformers-5 text with one top-level field replaced (raw JSON value) or, with "", dropped.
std::string v3_transformers5_with(const std::string& key, const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(kDeepSeekV3Transformers5Json);
  if (value.empty()) j.erase(key);
  else j[key] = nlohmann::json::parse(value);
  return j.dump(2);
}

TEST(ConfigJsonHf, Transformers5DeepSeekV3ReadsYarnThetaAndDtype) {
  const HfConfig hf = parse_hf_config_json(kDeepSeekV3Transformers5Json);
  EXPECT_EQ(hf.attention, preset_config("deepseek-v3"));
  ASSERT_TRUE(hf.attention.yarn.has_value()) << "rope_parameters was ignored";
  EXPECT_EQ(hf.attention.yarn->factor, 40.0);
  EXPECT_EQ(hf.attention.yarn->original_max_position_embeddings, 4096);
  EXPECT_EQ(hf.attention.yarn->beta_fast, 32.0);
  EXPECT_EQ(hf.attention.yarn->beta_slow, 1.0);
  EXPECT_EQ(hf.attention.yarn->mscale, 1.0);
  EXPECT_EQ(hf.attention.yarn->mscale_all_dim, 1.0);
  EXPECT_EQ(hf.attention.rope_theta, 10000.0);
  EXPECT_EQ(hf.attention.rope_layout, RopeLayout::interleaved);  // rope_interleave: true
  // 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.1352 (without YaRN it would be 0.0722).
  EXPECT_NEAR(hf.attention.scaling(), 0.1352, 5e-5);
  EXPECT_EQ(hf.dtype, std::optional<std::string>("bfloat16"));
  EXPECT_EQ(hf.num_hidden_layers, std::optional<int64_t>(61));
  EXPECT_EQ(parse_config_json(kDeepSeekV3Transformers5Json), hf.attention);
}

TEST(ConfigJsonHf, OlderRopeScalingFormGivesTheIdenticalConfig) {
  const HfConfig older = parse_hf_config_json(kDeepSeekV3ConfigJson);
  const HfConfig newer = parse_hf_config_json(kDeepSeekV3Transformers5Json);
  EXPECT_EQ(older.attention, newer.attention);
  EXPECT_EQ(older.attention.scaling(), newer.attention.scaling());
  EXPECT_NEAR(older.attention.scaling(), 0.1352, 5e-5);
  EXPECT_EQ(older.dtype, std::optional<std::string>("bfloat16"));  // torch_dtype
  EXPECT_EQ(older.num_hidden_layers, std::optional<int64_t>(61));
}

TEST(ConfigJsonHf, BothSpellingsAgreeingAreAccepted) {
  std::string text = v3_transformers5_with("rope_theta", "10000.0");
  nlohmann::json j = nlohmann::json::parse(text);
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                       {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  j["torch_dtype"] = "bfloat16";
  const HfConfig hf = parse_hf_config_json(j.dump());
  EXPECT_EQ(hf.attention, preset_config("deepseek-v3"));
  EXPECT_EQ(hf.dtype, std::optional<std::string>("bfloat16"));
  // rope_scaling: null beside rope_parameters means "not given" (HF: rope_scaling or rope_parameters).
  EXPECT_EQ(parse_config_json(v3_transformers5_with("rope_scaling", "null")), preset_config("deepseek-v3"));
}

TEST(ConfigJsonHf, DefaultRopeTypeWithTheta) {
  const MlaConfig c = parse_config_json(tiny_json({{"rope_parameters", R"({"rope_type": "default", "rope_theta": 50000})"}}));
  EXPECT_FALSE(c.yarn.has_value());
  EXPECT_EQ(c.rope_theta, 50000.0);
  // No rope_type: HF's default.
  EXPECT_EQ(parse_config_json(tiny_json({{"rope_parameters", R"({"rope_theta": 500})"}})).rope_theta, 500.0);
  // Older spelling of the type inside rope_parameters, and an attention_factor equal to the derived one.
  const MlaConfig y = parse_config_json(tiny_json(
      {{"rope_parameters", R"({"type": "yarn", "factor": 4, "mscale": 0.707, "mscale_all_dim": 0.707,
                               "attention_factor": 1.0, "truncate": true, "partial_rotary_factor": 1.0})"}}));
  ASSERT_TRUE(y.yarn.has_value());
  EXPECT_EQ(y.yarn->factor, 4.0);
  EXPECT_EQ(y.rope_magnitude_scale(), 1.0);
}

TEST(ConfigJsonHfErrors, ThetaGivenTwiceDiffering) {
  const std::string msg = error_of([] { parse_config_json(v3_transformers5_with("rope_theta", "50000")); });
  EXPECT_THAT(msg, HasSubstr("rope_theta is given twice with different values"));
  EXPECT_THAT(msg, HasSubstr("rope_theta=50000"));
  EXPECT_THAT(msg, HasSubstr("rope_parameters.rope_theta=10000"));
}

TEST(ConfigJsonHfErrors, RopeScalingAndRopeParametersDisagree) {
  std::string msg = error_of([] {
    parse_config_json(v3_transformers5_with("rope_scaling", R"({"type": "yarn", "factor": 32,
        "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0})"));
  });
  EXPECT_THAT(msg, HasSubstr("rope_scaling and rope_parameters disagree"));
  EXPECT_THAT(msg, HasSubstr("rope_scaling=yarn(factor 32"));
  EXPECT_THAT(msg, HasSubstr("rope_parameters=yarn(factor 40"));
  msg = error_of([] { parse_config_json(v3_transformers5_with("rope_scaling", R"({"rope_type": "default"})")); });
  EXPECT_THAT(msg, HasSubstr("rope_scaling and rope_parameters disagree"));
  EXPECT_THAT(msg, HasSubstr("rope_scaling=default (no YaRN)"));
}

TEST(ConfigJsonHfErrors, DtypeAndTorchDtypeDiffer) {
  const std::string msg = error_of([] { parse_config_json(v3_transformers5_with("torch_dtype", "\"float32\"")); });
  EXPECT_THAT(msg, HasSubstr("dtype and torch_dtype differ"));
  EXPECT_THAT(msg, HasSubstr("dtype=bfloat16"));
  EXPECT_THAT(msg, HasSubstr("torch_dtype=float32"));
}

TEST(ConfigJsonHfErrors, UnsupportedDtype) {
  const std::string msg = error_of([] { parse_config_json(v3_transformers5_with("dtype", "\"float8_e4m3fn\"")); });
  EXPECT_THAT(msg, HasSubstr("unsupported dtype"));
  EXPECT_THAT(msg, HasSubstr("dtype=float8_e4m3fn"));
  EXPECT_THAT(msg, HasSubstr("bf16"));
}

TEST(ConfigJsonHfErrors, UnknownRopeTypeNamesItAndTheSupportedOnes) {
  const std::string msg = error_of([] {
    parse_config_json(tiny_json({{"rope_parameters", R"({"rope_type": "llama3", "factor": 8, "rope_theta": 500000})"}}));
  });
  EXPECT_THAT(msg, HasSubstr("unsupported rope type"));
  EXPECT_THAT(msg, HasSubstr("rope_parameters.rope_type=llama3"));
  EXPECT_THAT(msg, HasSubstr("\"default\" (plain RoPE) and \"yarn\""));
}

TEST(ConfigJsonHfErrors, MathFieldsAreNeverIgnored) {
  struct Case {
    const char* rope_parameters;
    const char* expected;
    const char* value;
  };
  const Case cases[] = {
      {R"({"rope_type": "default", "factor": 4})", "has a YaRN field but its rope type is \"default\"", "field=factor"},
      {R"({"rope_type": "yarn", "factor": 4, "truncate": false})", "truncate=false is not supported", "truncate=false"},
      {R"({"rope_type": "yarn", "factor": 4, "attention_factor": 2.0})", "attention_factor must equal", "attention_factor=2"},
      {R"({"rope_type": "default", "partial_rotary_factor": 0.5})", "partial_rotary_factor must be 1",
       "partial_rotary_factor=0.5"},
      {R"({"rope_type": "yarn", "factor": 4, "low_freq_factor": 1})", "unknown field in rope_parameters",
       "field=low_freq_factor"},
      {R"({"full_attention": {"rope_type": "default"}})", "unknown field in rope_parameters", "field=full_attention"},
      {R"("yarn")", "rope_parameters must be an object or null", "rope_parameters=\"yarn\""},
      {R"({"rope_type": 3})", "rope_parameters.rope_type must be a string", "rope_type=3"},
      {R"({"rope_type": "yarn", "type": "default"})", "rope_parameters.type and rope_parameters.rope_type differ",
       "type=\"default\""},
  };
  for (const Case& k : cases) {
    const std::string msg = error_of([&] { parse_config_json(tiny_json({{"rope_parameters", k.rope_parameters}})); });
    EXPECT_THAT(msg, HasSubstr(k.expected)) << k.rope_parameters;
    EXPECT_THAT(msg, HasSubstr(k.value)) << k.rope_parameters;
  }
  // The older rope_scaling obeys the same rules.
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"rope_scaling", R"({"factor": 4})"}})); });
  EXPECT_THAT(msg, HasSubstr("rope_scaling has a YaRN field but its rope type is \"default\""));
}

TEST(ConfigJsonHfErrors, NumHiddenLayersMustBePositive) {
  const std::string msg = error_of([] { parse_config_json(tiny_json({{"num_hidden_layers", "0"}})); });
  EXPECT_THAT(msg, HasSubstr("num_hidden_layers must be >= 1"));
}

}  // namespace
}  // namespace mlacp
