#include "train/hf_decoder.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "mlacp/errors.h"

namespace mlacp::train {
namespace {

namespace fs = std::filesystem;
constexpr const char* kWhat = "checkpoint";
constexpr const char* kLayersPrefix = "layers.";
constexpr const char* kHfLayersPrefix = "model.layers.";
constexpr const char* kDescribeHint =
    "config.json must describe these weights: hidden_size, intermediate_size, vocab_size, num_hidden_layers and "
    "the attention sizes (num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
    "v_head_dim, attention_bias)";

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string join(const std::vector<std::string>& names, size_t limit = 8) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < limit; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > limit) text += ", ... (" + std::to_string(names.size()) + " in all)";
  return "[" + text + "]";
}

// The rotary tables HF recomputes from the config (older checkpoints saved them as buffers).
bool ignored_tensor(const std::string& name) {
  if (ends_with(name, "inv_freq")) return true;
  std::stringstream parts(name);
  for (std::string part; std::getline(parts, part, '.');)
    if (part == "rotary_emb") return true;
  return false;
}

// "model.layers.12.mlp.gate.weight" -> {12, "mlp.gate.weight"}; nullopt outside the layers.
std::optional<std::pair<int64_t, std::string>> split_layer(const std::string& name) {
  const std::string head = kHfLayersPrefix;
  if (!starts_with(name, head)) return std::nullopt;
  const size_t dot = name.find('.', head.size());
  const std::string index = name.substr(head.size(), dot == std::string::npos ? std::string::npos : dot - head.size());
  if (index.empty() || index.size() > 9 || index.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return std::make_pair(std::stoll(index), dot == std::string::npos ? std::string() : name.substr(dot + 1));
}

// A layer tensor of DeepSeek's MoE block (router, routed and shared experts).
bool moe_tensor(const std::string& in_layer) {
  return starts_with(in_layer, "mlp.experts.") || starts_with(in_layer, "mlp.gate.") ||
         starts_with(in_layer, "mlp.shared_experts.");
}

bool floating_dtype(const std::string& dtype) {
  return dtype == "F16" || dtype == "BF16" || dtype == "F32" || dtype == "F64";
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

}  // namespace

std::string hf_tensor_name(const std::string& parameter) {
  if (starts_with(parameter, "lm_head.")) return parameter;
  if (starts_with(parameter, kLayersPrefix)) {
    const size_t dot = parameter.find('.', std::string(kLayersPrefix).size());
    if (dot != std::string::npos) {
      const std::string rest = parameter.substr(dot + 1);
      for (const char* mlp : {"gate_proj.", "up_proj.", "down_proj."})
        if (starts_with(rest, mlp)) return "model." + parameter.substr(0, dot + 1) + "mlp." + rest;
    }
  }
  return "model." + parameter;
}

DecoderConfig load_hf_decoder_config(const std::string& folder) {
  std::error_code ec;
  MLACP_REQUIRE(fs::is_directory(folder, ec), kWhat, "the checkpoint must be a folder", {got("folder", folder)},
                "pass the folder holding config.json and the safetensors files");
  const std::string path = (fs::path(folder) / "config.json").string();
  MLACP_REQUIRE(fs::exists(path, ec), kWhat, "the checkpoint folder has no config.json", {got("folder", folder)},
                "a HuggingFace model folder holds config.json next to its safetensors");
  DecoderConfig c;
  try {
    c = load_decoder_config(path);
  } catch (const Error& e) {
    std::vector<ErrorValue> values = e.values();
    bool named = false;
    for (const ErrorValue& v : values) named = named || v.value == path;
    if (!named) values.push_back(got("file", path));
    throw Error(e.subject(), e.rule(), values, e.hint());
  }
  const nlohmann::json j = read_json(path);  // load_decoder_config parsed it: an object
  for (const char* key : {"num_hidden_layers", "intermediate_size"}) {
    MLACP_REQUIRE(j.contains(key) && !j.at(key).is_null(), kWhat,
                  std::string("config.json must give ") + key + " to train from the checkpoint",
                  {got("file", path), got("field", key)}, "write the model's own config.json (save_pretrained does)");
  }
  if (j.contains("tie_word_embeddings") && !j.at("tie_word_embeddings").is_null()) {
    MLACP_REQUIRE(j.at("tie_word_embeddings").is_boolean(), kWhat, "tie_word_embeddings must be true or false",
                  {got("file", path), got("tie_word_embeddings", j.at("tie_word_embeddings").dump())}, "fix config.json");
    MLACP_REQUIRE(!j.at("tie_word_embeddings").get<bool>(), kWhat,
                  "tie_word_embeddings is true, but mlacp train's decoder has its own lm_head (it cannot tie it to "
                  "embed_tokens)",
                  {got("file", path), got("tie_word_embeddings", true)},
                  "untie the checkpoint: save lm_head.weight (a copy of model.embed_tokens.weight) and set "
                  "tie_word_embeddings to false; training then updates the two separately");
  }
  if (j.contains("hidden_act") && !j.at("hidden_act").is_null()) {
    const nlohmann::json& act = j.at("hidden_act");
    MLACP_REQUIRE(act.is_string() && act.get<std::string>() == "silu", kWhat,
                  "mlacp train's MLP is SwiGLU: hidden_act must be \"silu\"", {got("file", path), got("hidden_act", act.dump())},
                  "train a checkpoint whose MLP uses silu (DeepSeek-V3's does)");
  }
  if (j.contains("mlp_bias") && !j.at("mlp_bias").is_null()) {
    const nlohmann::json& bias = j.at("mlp_bias");
    MLACP_REQUIRE(bias.is_boolean() && !bias.get<bool>(), kWhat, "mlacp train's MLP has no biases: mlp_bias must be false",
                  {got("file", path), got("mlp_bias", bias.dump())}, "train a checkpoint without MLP biases");
  }
  return c;
}

std::string HfDecoderInit::describe() const {
  std::ostringstream out;
  out << "initialised from " << folder << ": " << tensors << " tensors, " << layers << " layers";
  if (!ignored.empty()) out << " (ignored " << ignored.size() << " rotary table" << (ignored.size() > 1 ? "s" : "") << ")";
  return out.str();
}

HfDecoderInit check_hf_decoder_checkpoint(const HfCheckpoint& checkpoint, const DecoderConfig& config) {
  config.validate();
  HfDecoderInit init;
  init.folder = checkpoint.folder();
  init.layers = config.num_layers;
  const auto shapes = decoder_parameter_shapes(config);
  std::map<std::string, std::vector<int64_t>> expected;  // HF name -> shape
  for (const auto& [name, shape] : shapes) expected[hf_tensor_name(name)] = shape;

  std::set<int64_t> moe_layers;
  std::vector<std::string> moe, beyond, unused, missing;
  for (const std::string& name : checkpoint.tensor_names()) {  // sorted
    if (expected.count(name)) continue;
    if (ignored_tensor(name)) {
      init.ignored.push_back(name);
      continue;
    }
    const auto layer = split_layer(name);
    if (layer && layer->first >= config.num_layers) {
      beyond.push_back(name);
    } else if (layer && moe_tensor(layer->second)) {
      moe_layers.insert(layer->first);
      moe.push_back(name);
    } else {
      unused.push_back(name);
    }
  }
  for (const auto& [name, shape] : expected)
    if (!checkpoint.has_tensor(name)) missing.push_back(name);

  if (!moe.empty()) {
    const std::string first = std::to_string(*moe_layers.begin());
    fail(kWhat, "mlacp train's decoder is dense; layer " + first + " of the checkpoint is a MoE layer",
         {got("folder", init.folder), got("moe_layers", std::vector<int64_t>(moe_layers.begin(), moe_layers.end())),
          got("tensors", join(moe))},
         "train from a dense checkpoint (every layer with mlp.gate_proj, mlp.up_proj and mlp.down_proj), or check "
         "the attention of a MoE model's layers with mlacp verify --checkpoint " + init.folder + " --layer " + first);
  }
  MLACP_REQUIRE(beyond.empty(), kWhat, "the checkpoint holds tensors of layers the decoder does not have",
                {got("folder", init.folder), got("num_hidden_layers", config.num_layers), got("tensors", join(beyond))},
                "config.json's num_hidden_layers must count the checkpoint's layers; extra layers such as "
                "DeepSeek-V3's multi-token-prediction layer (num_nextn_predict_layers) are not part of mlacp train's "
                "decoder: remove their tensors");
  if (!missing.empty()) {
    std::vector<ErrorValue> values{got("folder", init.folder), got("missing", join(missing))};
    if (!unused.empty()) values.push_back(got("unused", join(unused)));
    fail(kWhat, "parameters of mlacp train's decoder are missing from the checkpoint", values,
         std::string("a dense DeepSeek-V3 decoder holds model.embed_tokens, model.layers.N.{input_layernorm, "
                     "self_attn.*, post_attention_layernorm, mlp.gate_proj, mlp.up_proj, mlp.down_proj}, model.norm "
                     "and lm_head; ") + kDescribeHint);
  }
  MLACP_REQUIRE(unused.empty(), kWhat, "the checkpoint holds tensors mlacp train's decoder has no parameter for",
                {got("folder", init.folder), got("unused", join(unused))},
                "the decoder has no biases outside attention_bias's and no other modules: remove these tensors, or "
                "fix config.json (attention_bias, q_lora_rank, mlacp.output_gate)");
  for (const auto& [name, shape] : shapes) {
    const std::string hf = hf_tensor_name(name);
    checkpoint.require_readable(hf);  // fp8 and other dtypes LibTorch cannot hold: the way out
    const HfTensorInfo info = checkpoint.tensor_info(hf);
    MLACP_REQUIRE(floating_dtype(info.dtype), kWhat, "a parameter tensor must be stored as floating point",
                  {got("file", info.file), got("tensor", hf), got("dtype", info.dtype)},
                  "store the weights as bf16, f16, f32 or f64");
    MLACP_REQUIRE(info.shape == shape, kWhat, "a tensor's shape does not match the decoder's parameter",
                  {got("file", info.file), got("tensor", hf), got("shape", info.shape), got("expected", shape)},
                  kDescribeHint);
  }
  init.tensors = static_cast<int64_t>(shapes.size());
  return init;
}

HfDecoderInit load_hf_decoder_checkpoint(DecoderLm& model, const HfCheckpoint& checkpoint) {
  const auto shapes = decoder_parameter_shapes(model->config());
  auto parameters = model->named_parameters();
  bool fresh = parameters.size() == shapes.size();
  for (size_t i = 0; fresh && i < shapes.size(); ++i)
    fresh = parameters[i].key() == shapes[i].first && parameters[i].value().sizes().vec() == shapes[i].second;
  MLACP_REQUIRE(fresh, kWhat, "load the checkpoint into a fresh decoder, before its heads are sharded over TP",
                {got("folder", checkpoint.folder())}, "call load_hf_decoder_checkpoint before DecoderLm::parallelize");
  HfDecoderInit init = check_hf_decoder_checkpoint(checkpoint, model->config());
  at::NoGradGuard no_grad;
  for (auto& item : parameters)  // one tensor at a time, converted to the parameter's dtype
    item.value().copy_(checkpoint.read_tensor(hf_tensor_name(item.key())));
  return init;
}

}  // namespace mlacp::train
