// HuggingFace-style config.json <-> MlaConfig. Field names are DeepSeek-V3's; mlacp's own
// extensions live under "mlacp". Unknown fields and contradictions are errors. Both HF spellings
// of RoPE and dtype are read (transformers 5: rope_parameters, dtype; older: rope_scaling +
// rope_theta, torch_dtype); written is the older one, which transformers 5 still reads.
#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "mlacp/config.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

using nlohmann::json;
constexpr const char* kWhat = "config.json";

// Model-level fields that are not part of the attention layer: recognised, not used.
const std::set<std::string>& ignored_model_fields() {
  static const std::set<std::string> fields = {
      "architectures", "auto_map", "model_type", "vocab_size", "intermediate_size",
      "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
      "ep_size", "routed_scaling_factor", "topk_method", "n_group", "topk_group",
      "num_experts_per_tok", "moe_layer_freq", "first_k_dense_replace", "norm_topk_prob",
      "scoring_func", "aux_loss_alpha", "seq_aux", "hidden_act", "initializer_range", "use_cache",
      "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp", "tie_word_embeddings",
      "transformers_version", "quantization_config", "num_nextn_predict_layers", "mlp_bias",
      "output_router_logits", "router_aux_loss_coef"};  // the last two: written by transformers 5 save_pretrained
  return fields;
}

const std::set<std::string> kAttentionFields = {
    "hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave", "attention_bias", "attention_dropout",
    "max_position_embeddings", "mlacp",
    // model-level, read into HfConfig
    "num_hidden_layers", "dtype", "torch_dtype"};
// The fields of one rope setting: HF's rope_scaling (older) and rope_parameters (transformers 5)
// hold the same ones.
const std::set<std::string> kRopeFields = {"type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings",
                                           "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                           "truncate", "partial_rotary_factor"};
// Fields that only mean something with rope type "yarn".
const std::set<std::string> kYarnOnlyFields = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                               "mscale", "mscale_all_dim", "attention_factor", "truncate"};
const std::set<std::string> kMlacpFields = {"output_gate", "causal", "up_proj_bias", "softmax_scale"};
const char* const kSupportedRopeTypes =
    "mlacp supports rope types \"default\" (plain RoPE) and \"yarn\" (DeepSeek's YaRN)";

void reject_unknown(const json& object, const std::set<std::string>& known, const std::set<std::string>* ignored,
                    const std::string& where) {
  for (const auto& item : object.items()) {
    if (known.count(item.key()) || (ignored && ignored->count(item.key()))) continue;
    throw Error(kWhat, "unknown field in " + where, {got("field", item.key())},
                "remove it, or check its spelling against the DeepSeek-V3 config.json");
  }
}

bool given(const json& j, const std::string& key) { return j.contains(key) && !j.at(key).is_null(); }

int64_t get_int(const json& j, const std::string& key) {
  MLACP_REQUIRE(j.contains(key), kWhat, "required field is missing", {got("field", key)},
          "add it (see mlacp's presets for DeepSeek values)");
  const json& v = j.at(key);
  MLACP_REQUIRE(v.is_number_integer(), kWhat, "field must be an integer", {got("field", key), got("value", v.dump())},
          "write it without quotes or decimals");
  MLACP_REQUIRE(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), kWhat,
                "integer field is out of range", {got("field", key), got("value", v.dump())},
                "use a value below 2^63");
  return v.get<int64_t>();
}

double get_number(const json& j, const std::string& key, double fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const json& v = j.at(key);
  MLACP_REQUIRE(v.is_number(), kWhat, "field must be a number", {got("field", key), got("value", v.dump())},
          "write it as a JSON number");
  return v.get<double>();
}

bool get_bool(const json& j, const std::string& key, bool fallback) {
  if (!j.contains(key)) return fallback;
  const json& v = j.at(key);
  MLACP_REQUIRE(v.is_boolean(), kWhat, "field must be true or false", {got("field", key), got("value", v.dump())},
          "write true or false without quotes");
  return v.get<bool>();
}

// One rope setting, from rope_scaling or rope_parameters (`where` names which).
struct RopeReading {
  std::optional<double> theta;      // its rope_theta, when it holds one
  std::optional<YarnScaling> yarn;  // none: rope type "default" (plain RoPE)
};

RopeReading parse_rope(const json& s, const std::string& where) {
  MLACP_REQUIRE(s.is_object(), kWhat, where + " must be an object or null", {got(where, s.dump())},
          "use {\"rope_type\": \"yarn\", \"factor\": ...}, {\"rope_type\": \"default\"} or null");
  reject_unknown(s, kRopeFields, nullptr, where);
  for (const char* name : {"type", "rope_type"}) {
    MLACP_REQUIRE(!given(s, name) || s.at(name).is_string(), kWhat, where + "." + name + " must be a string",
                  {got(name, s.contains(name) ? s.at(name).dump() : "")}, "use \"yarn\" or \"default\"");
  }
  if (given(s, "type") && given(s, "rope_type")) {
    MLACP_REQUIRE(s.at("type") == s.at("rope_type"), kWhat, where + ".type and " + where + ".rope_type differ",
            {got("type", s.at("type").dump()), got("rope_type", s.at("rope_type").dump())}, "keep one of them");
  }
  // HF's rule: rope_type, else the older "type", else "default".
  const std::string type_key = given(s, "rope_type") ? "rope_type" : (given(s, "type") ? "type" : "");
  const std::string type = type_key.empty() ? "default" : s.at(type_key).get<std::string>();
  MLACP_REQUIRE(type == "yarn" || type == "default", kWhat, "unsupported rope type",
                {got(where + "." + type_key, type)}, std::string(kSupportedRopeTypes) + "; convert the model or drop " + where);
  RopeReading r;
  if (given(s, "rope_theta")) r.theta = get_number(s, "rope_theta", 10000.0);
  if (given(s, "partial_rotary_factor")) {
    const double partial = get_number(s, "partial_rotary_factor", 1.0);
    MLACP_REQUIRE(partial == 1.0, kWhat, where + ".partial_rotary_factor must be 1 (MLA rotates all qk_rope_head_dim lanes)",
                  {got("partial_rotary_factor", partial)}, "drop it; the rope width is qk_rope_head_dim");
  }
  if (type == "default") {
    for (const std::string& field : kYarnOnlyFields) {
      MLACP_REQUIRE(!given(s, field), kWhat, where + " has a YaRN field but its rope type is \"default\"",
                    {got("field", field), got(where, s.dump())},
                    "set \"rope_type\": \"yarn\" if the model uses YaRN, or drop the field");
    }
    return r;
  }
  YarnScaling y;
  y.factor = get_number(s, "factor", 1.0);
  if (given(s, "original_max_position_embeddings")) y.original_max_position_embeddings =
      get_int(s, "original_max_position_embeddings");
  y.beta_fast = get_number(s, "beta_fast", 32.0);
  y.beta_slow = get_number(s, "beta_slow", 1.0);
  y.mscale = get_number(s, "mscale", 1.0);
  y.mscale_all_dim = get_number(s, "mscale_all_dim", 0.0);
  if (given(s, "truncate")) {
    MLACP_REQUIRE(get_bool(s, "truncate", true), kWhat,
                  where + ".truncate=false is not supported (mlacp's YaRN rounds the correction range, as DeepSeek's)",
                  {got("truncate", false)}, "drop truncate or set it to true");
  }
  if (given(s, "attention_factor")) {
    // HF's attention_factor is the cos/sin multiplier that mlacp derives from the mscales.
    const double given_factor = get_number(s, "attention_factor", 1.0);
    const double derived = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
    MLACP_REQUIRE(std::abs(given_factor - derived) <= 1e-12 * std::max(1.0, std::abs(derived)), kWhat,
                  where + ".attention_factor must equal mscale(factor, mscale) / mscale(factor, mscale_all_dim)",
                  {got("attention_factor", given_factor), got("derived", derived), got("factor", y.factor),
                   got("mscale", y.mscale), got("mscale_all_dim", y.mscale_all_dim)},
                  "mlacp derives the YaRN magnitude from mscale and mscale_all_dim (DeepSeek's rule); drop attention_factor");
  }
  r.yarn = y;
  return r;
}

std::string describe_yarn(const std::optional<YarnScaling>& y) {
  if (!y) return "default (no YaRN)";
  std::ostringstream out;
  out << "yarn(factor " << y->factor << ", original_max_position_embeddings " << y->original_max_position_embeddings
      << ", beta_fast " << y->beta_fast << ", beta_slow " << y->beta_slow << ", mscale " << y->mscale
      << ", mscale_all_dim " << y->mscale_all_dim << ")";
  return out.str();
}

std::optional<std::string> get_dtype(const json& j, const std::string& key) {
  if (!given(j, key)) return std::nullopt;
  const json& v = j.at(key);
  MLACP_REQUIRE(v.is_string(), kWhat, "field must be a string", {got("field", key), got("value", v.dump())},
                "write the dtype name in quotes, e.g. \"bfloat16\"");
  const std::string name = v.get<std::string>();
  static const std::set<std::string> known = {"float16", "bfloat16", "float32", "float64"};
  MLACP_REQUIRE(known.count(name), kWhat, "unsupported dtype", {got(key, name)},
                "mlacp reads float16, bfloat16, float32 and float64 models; dequantise fp8 models to bf16 first");
  return name;
}

}  // namespace

HfConfig parse_hf_config_json(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::parse_error& e) {
    throw Error(kWhat, "not valid JSON", {got("parser", e.what())}, "check the file with a JSON validator");
  }
  MLACP_REQUIRE(j.is_object(), kWhat, "top level must be an object", {got("type", j.type_name())},
          "a config.json is one JSON object");
  reject_unknown(j, kAttentionFields, &ignored_model_fields(), "the config");

  HfConfig hf;
  MlaConfig& c = hf.attention;
  c.hidden_size = get_int(j, "hidden_size");
  c.num_heads = get_int(j, "num_attention_heads");
  if (j.contains("q_lora_rank") && !j.at("q_lora_rank").is_null()) c.q_lora_rank = get_int(j, "q_lora_rank");
  c.kv_lora_rank = get_int(j, "kv_lora_rank");
  c.qk_nope_head_dim = get_int(j, "qk_nope_head_dim");
  c.qk_rope_head_dim = get_int(j, "qk_rope_head_dim");
  c.v_head_dim = get_int(j, "v_head_dim");
  c.rms_norm_eps = get_number(j, "rms_norm_eps", 1e-6);
  // DeepSeek's own modeling code always de-interleaves; HF writes rope_interleave explicitly
  // (true: interleaved lane pairs, the DeepSeek reference layout).
  c.rope_layout = get_bool(j, "rope_interleave", true) ? RopeLayout::interleaved : RopeLayout::half_split;

  // RoPE: older HF writes rope_scaling + top-level rope_theta, transformers 5 rope_parameters.
  std::optional<RopeReading> scaling, parameters;
  if (given(j, "rope_scaling")) scaling = parse_rope(j.at("rope_scaling"), "rope_scaling");
  if (given(j, "rope_parameters")) parameters = parse_rope(j.at("rope_parameters"), "rope_parameters");
  std::vector<std::pair<std::string, double>> thetas;
  if (given(j, "rope_theta")) thetas.emplace_back("rope_theta", get_number(j, "rope_theta", 10000.0));
  if (scaling && scaling->theta) thetas.emplace_back("rope_scaling.rope_theta", *scaling->theta);
  if (parameters && parameters->theta) thetas.emplace_back("rope_parameters.rope_theta", *parameters->theta);
  for (const auto& [name, value] : thetas) {
    MLACP_REQUIRE(value == thetas.front().second, kWhat, "rope_theta is given twice with different values",
                  {got(thetas.front().first, thetas.front().second), got(name, value)},
                  "keep one of them (transformers 5 writes rope_parameters.rope_theta)");
  }
  c.rope_theta = thetas.empty() ? 10000.0 : thetas.front().second;
  if (scaling && parameters) {
    MLACP_REQUIRE(scaling->yarn == parameters->yarn, kWhat, "rope_scaling and rope_parameters disagree",
                  {got("rope_scaling", describe_yarn(scaling->yarn)), got("rope_parameters", describe_yarn(parameters->yarn))},
                  "keep one of them (transformers 5 writes rope_parameters)");
  }
  c.yarn = parameters ? parameters->yarn : (scaling ? scaling->yarn : std::nullopt);

  if (j.contains("max_position_embeddings")) c.max_position_embeddings = get_int(j, "max_position_embeddings");
  c.attention_bias = get_bool(j, "attention_bias", false);
  c.attention_dropout = get_number(j, "attention_dropout", 0.0);

  // Model-level fields a checkpoint reader needs.
  if (given(j, "num_hidden_layers")) {
    hf.num_hidden_layers = get_int(j, "num_hidden_layers");
    MLACP_REQUIRE(*hf.num_hidden_layers >= 1, kWhat, "num_hidden_layers must be >= 1",
                  {got("num_hidden_layers", *hf.num_hidden_layers)}, "fix the config or drop the field");
  }
  const std::optional<std::string> dtype = get_dtype(j, "dtype"), torch_dtype = get_dtype(j, "torch_dtype");
  MLACP_REQUIRE(!dtype || !torch_dtype || *dtype == *torch_dtype, kWhat, "dtype and torch_dtype differ",
                {got("dtype", *dtype), got("torch_dtype", *torch_dtype)},
                "keep one of them (transformers 5 writes dtype)");
  hf.dtype = dtype ? dtype : torch_dtype;

  // Contradictions between redundant fields.
  if (j.contains("num_key_value_heads")) {
    const int64_t kv_heads = get_int(j, "num_key_value_heads");
    MLACP_REQUIRE(kv_heads == c.num_heads, kWhat, "MLA needs num_key_value_heads == num_attention_heads",
            {got("num_key_value_heads", kv_heads), got("num_attention_heads", c.num_heads)},
            "MLA expands keys per head from the latent; fix the config");
  }
  if (j.contains("qk_head_dim")) {
    const int64_t qk = get_int(j, "qk_head_dim");
    MLACP_REQUIRE(qk == c.qk_head_dim(), kWhat, "qk_head_dim must equal qk_nope_head_dim + qk_rope_head_dim",
            {got("qk_head_dim", qk), got("qk_nope_head_dim", c.qk_nope_head_dim),
             got("qk_rope_head_dim", c.qk_rope_head_dim)},
            "drop qk_head_dim or make it consistent");
  }
  if (j.contains("head_dim")) {
    const int64_t hd = get_int(j, "head_dim");
    MLACP_REQUIRE(hd == c.qk_rope_head_dim || hd == c.qk_head_dim(), kWhat,
            "head_dim must equal qk_rope_head_dim (HF DeepSeek-V3) or qk_nope_head_dim + qk_rope_head_dim",
            {got("head_dim", hd), got("qk_rope_head_dim", c.qk_rope_head_dim), got("qk_head_dim", c.qk_head_dim())},
            "drop head_dim or make it consistent");
  }
  if (j.contains("mlacp")) {
    const json& m = j.at("mlacp");
    MLACP_REQUIRE(m.is_object(), kWhat, "\"mlacp\" must be an object", {got("mlacp", m.dump())},
            "use {\"output_gate\": false, ...}");
    reject_unknown(m, kMlacpFields, nullptr, "mlacp");
    c.output_gate = get_bool(m, "output_gate", false);
    c.causal = get_bool(m, "causal", true);
    c.up_proj_bias = get_bool(m, "up_proj_bias", false);
    if (m.contains("softmax_scale") && !m.at("softmax_scale").is_null()) {
      c.softmax_scale = get_number(m, "softmax_scale", 0.0);
    }
  }
  c.validate();
  return hf;
}

MlaConfig parse_config_json(const std::string& json_text) { return parse_hf_config_json(json_text).attention; }

HfConfig load_hf_config_file(const std::string& path) {
  constexpr std::streamsize kMaxBytes = 4 << 20;  // a config.json is a few KB; never read without bound
  std::error_code ec;
  std::ifstream in(path, std::ios::binary);
  MLACP_REQUIRE(static_cast<bool>(in), kWhat, "cannot open file", {got("path", path)},
          "check the path, or use a preset (deepseek-v3, deepseek-v2-lite, tiny)");
  MLACP_REQUIRE(std::filesystem::is_regular_file(path, ec), kWhat, "the config must be a regular file",
                {got("path", path)}, "pass a config.json file, or use a preset (deepseek-v3, deepseek-v2-lite, tiny)");
  std::string text(static_cast<size_t>(kMaxBytes) + 1, '\0');
  in.read(text.data(), kMaxBytes + 1);
  text.resize(static_cast<size_t>(in.gcount()));
  MLACP_REQUIRE(static_cast<std::streamsize>(text.size()) <= kMaxBytes, kWhat, "the config file is larger than 4 MiB",
                {got("path", path)}, "pass the model's config.json, not another file");
  return parse_hf_config_json(text);
}

MlaConfig load_config_file(const std::string& path) { return load_hf_config_file(path).attention; }

std::string config_to_json(const MlaConfig& c, int indent) {
  json j;
  j["hidden_size"] = c.hidden_size;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_heads;
  j["q_lora_rank"] = c.q_lora_rank ? json(*c.q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = c.kv_lora_rank;
  j["qk_nope_head_dim"] = c.qk_nope_head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["v_head_dim"] = c.v_head_dim;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_interleave"] = c.rope_layout == RopeLayout::interleaved;
  if (c.yarn) {
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", c.yarn->factor},
                         {"original_max_position_embeddings", c.yarn->original_max_position_embeddings},
                         {"beta_fast", c.yarn->beta_fast},
                         {"beta_slow", c.yarn->beta_slow},
                         {"mscale", c.yarn->mscale},
                         {"mscale_all_dim", c.yarn->mscale_all_dim}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["attention_bias"] = c.attention_bias;
  j["attention_dropout"] = c.attention_dropout;
  json m = {{"output_gate", c.output_gate}, {"causal", c.causal}, {"up_proj_bias", c.up_proj_bias}};
  if (c.softmax_scale) m["softmax_scale"] = *c.softmax_scale;
  j["mlacp"] = m;
  return j.dump(indent);
}

}  // namespace mlacp
