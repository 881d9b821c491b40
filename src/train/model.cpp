#include "train/model.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <torch/csrc/autograd/autograd.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "train/data.h"

namespace mlacp::train {
namespace {

constexpr const char* kWhat = "decoder config";
constexpr const char* kAttentionPrefix = "self_attn.";

torch::nn::Linear linear(int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); }

// "layers.3.self_attn.kv_b_proj.weight" -> "kv_b_proj.weight"; "" outside attention.
std::string attention_parameter(const std::string& name) {
  const size_t at = name.find(kAttentionPrefix);
  return at == std::string::npos ? std::string() : name.substr(at + std::string(kAttentionPrefix).size());
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// One decoder layer with its activations recomputed in the backward: the forward runs without a
// graph (only `hidden` is kept: the caller's tensor, which the next layer's input is anyway); the
// backward runs the layer again with one and differentiates it for the incoming gradient. Inputs
// of the node: hidden and every parameter of the layer that requires a gradient.
at::Tensor recomputed_layer(DecoderLayer layer, const at::Tensor& hidden, const std::vector<MlaForwardOptions>& options) {
  std::vector<at::Tensor> params;
  for (const auto& p : layer->parameters())
    if (p.requires_grad()) params.push_back(p);
  if (!at::GradMode::is_enabled() || (params.empty() && !hidden.requires_grad())) return layer(hidden, options);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = layer(hidden, options);
  }
  std::vector<at::Tensor> inputs{hidden};
  inputs.insert(inputs.end(), params.begin(), params.end());
  const SavedForBackward saved({hidden.detach()}, {"decoder layer input"});
  const compat::AutocastSnapshot autocast = compat::AutocastSnapshot::capture(hidden.device().type());
  const bool hidden_grad = hidden.requires_grad();
  const std::shared_ptr<DecoderLayerImpl> impl = layer.ptr();
  BackwardFn backward = [impl, options, params, saved, autocast, hidden_grad](std::vector<at::Tensor> g) {
    saved.check("decoder layer recomputation");
    at::Tensor x = saved[0].detach().requires_grad_(hidden_grad);
    at::Tensor y;
    {
      at::AutoGradMode grad_on(true);
      const auto autocast_guard = autocast.enter();
      y = impl->forward(x, options);
    }
    std::vector<at::Tensor> wrt;
    if (hidden_grad) wrt.push_back(x);
    wrt.insert(wrt.end(), params.begin(), params.end());
    std::vector<at::Tensor> grads = torch::autograd::grad({y}, wrt, {g[0]}, /*retain_graph=*/false,
                                                          /*create_graph=*/false, /*allow_unused=*/true);
    if (!hidden_grad) grads.insert(grads.begin(), at::Tensor());
    return grads;
  };
  return attach_backward(inputs, {out}, "RecomputedDecoderLayer", std::move(backward))[0];
}

}  // namespace

// ---------------------------------------------------------------------------------------------
void DecoderConfig::validate() const {
  attention.validate();
  MLACP_REQUIRE(vocab_size == ByteTokenizer::kVocabSize, kWhat, "vocab_size must be the byte tokenizer's 256",
                {got("vocab_size", vocab_size)}, "mlacp train is byte-level");
  MLACP_REQUIRE(num_layers >= 1, kWhat, "num_layers must be >= 1", {got("num_layers", num_layers)},
                "use at least one decoder layer");
  MLACP_REQUIRE(intermediate_size >= 1, kWhat, "intermediate_size must be >= 1",
                {got("intermediate_size", intermediate_size)}, "e.g. 3 * hidden_size");
}

bool DecoderConfig::operator==(const DecoderConfig& other) const {
  return attention == other.attention && vocab_size == other.vocab_size && num_layers == other.num_layers &&
         intermediate_size == other.intermediate_size;
}

std::string DecoderConfig::describe() const {
  const MlaConfig& a = attention;
  std::ostringstream out;
  out << "layers=" << num_layers << " hidden=" << a.hidden_size << " heads=" << a.num_heads
      << " Rq=" << (a.q_lora_rank ? std::to_string(*a.q_lora_rank) : "none") << " Rkv=" << a.kv_lora_rank
      << " Dn=" << a.qk_nope_head_dim << " Dr=" << a.qk_rope_head_dim << " Dv=" << a.v_head_dim
      << " mlp=" << intermediate_size << " vocab=" << vocab_size;
  return out.str();
}

DecoderConfig decoder_preset(const std::string& name) {
  DecoderConfig c;
  MlaConfig& a = c.attention;
  if (name == "small") {
    a.hidden_size = 64; a.num_heads = 4; a.q_lora_rank = 32; a.kv_lora_rank = 32;
    a.qk_nope_head_dim = 16; a.qk_rope_head_dim = 8; a.v_head_dim = 16;
    c.num_layers = 2; c.intermediate_size = 192;
  } else if (name == "test") {
    a.hidden_size = 32; a.num_heads = 4; a.q_lora_rank = 16; a.kv_lora_rank = 16;
    a.qk_nope_head_dim = 8; a.qk_rope_head_dim = 4; a.v_head_dim = 8;
    c.num_layers = 2; c.intermediate_size = 64;
  } else {
    fail(kWhat, "unknown decoder preset", {got("preset", name)}, "choose small or test, or pass --config FILE");
  }
  c.validate();
  return c;
}

std::vector<std::string> decoder_preset_names() { return {"small", "test"}; }

DecoderConfig load_decoder_config(const std::string& path) {
  DecoderConfig c;
  c.attention = load_config_file(path);  // validates the attention fields (and the file's existence)
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto integer = [&](const char* key, int64_t fallback) {
    if (!j.is_object() || !j.contains(key)) return fallback;
    MLACP_REQUIRE(j[key].is_number_integer(), kWhat, std::string(key) + " must be an integer",
                  {got(key, j[key].dump()), got("path", path)}, "fix the config file");
    return j[key].get<int64_t>();
  };
  c.num_layers = integer("num_hidden_layers", 2);
  c.intermediate_size = integer("intermediate_size", 3 * c.attention.hidden_size);
  const int64_t vocab = integer("vocab_size", ByteTokenizer::kVocabSize);
  MLACP_REQUIRE(vocab == ByteTokenizer::kVocabSize, kWhat,
                "mlacp train trains a byte-level model: vocab_size must be its byte tokenizer's 256",
                {got("vocab_size", vocab), got("path", path)},
                "a model with another vocabulary cannot be trained by mlacp train (set vocab_size to 256 in a "
                "config of your own); check a checkpoint's attention layers with mlacp verify --checkpoint DIR");
  c.vocab_size = vocab;
  c.validate();
  return c;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> decoder_parameter_shapes(const DecoderConfig& config) {
  // Mirrors the constructors' registration order (a test checks it against named_parameters()).
  const int64_t d = config.attention.hidden_size, v = config.vocab_size, m = config.intermediate_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes{{"embed_tokens.weight", {v, d}}};
  const auto attention = mla_parameter_shapes(config.attention);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    shapes.push_back({p + "input_layernorm.weight", {d}});
    for (const auto& [name, shape] : attention) shapes.push_back({p + kAttentionPrefix + name, shape});
    shapes.push_back({p + "post_attention_layernorm.weight", {d}});
    shapes.push_back({p + "gate_proj.weight", {m, d}});
    shapes.push_back({p + "up_proj.weight", {m, d}});
    shapes.push_back({p + "down_proj.weight", {d, m}});
  }
  shapes.push_back({"norm.weight", {d}});
  shapes.push_back({"lm_head.weight", {v, d}});
  return shapes;
}

// ---------------------------------------------------------------------------------------------
DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& config, const at::TensorOptions& options) {
  const MlaConfig& a = config.attention;
  input_layernorm = register_module("input_layernorm", RmsNorm(a.hidden_size, a.rms_norm_eps, options));
  self_attn = register_module("self_attn", MlaAttention(a, options));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RmsNorm(a.hidden_size, a.rms_norm_eps, options));
  gate_proj = register_module("gate_proj", linear(a.hidden_size, config.intermediate_size));
  up_proj = register_module("up_proj", linear(a.hidden_size, config.intermediate_size));
  down_proj = register_module("down_proj", linear(config.intermediate_size, a.hidden_size));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& hidden, const std::vector<MlaForwardOptions>& row_options) {
  const int64_t batch = hidden.size(0);
  at::Tensor x = input_layernorm(hidden);  // [B, S_l, d]
  bool packed = false;
  for (const auto& o : row_options) packed = packed || o.document_ends.has_value();
  at::Tensor attention;
  if (!packed) {
    attention = self_attn(x, row_options.empty() ? MlaForwardOptions{} : row_options.front());  // [B, S_l, d]
  } else {
    std::vector<at::Tensor> rows;  // packed rows need batch 1: one attention call per row
    for (int64_t b = 0; b < batch; ++b) rows.push_back(self_attn(x.narrow(0, b, 1), row_options[b]));  // [1, S_l, d]
    attention = batch == 1 ? rows.front() : at::cat(rows, 0);  // [B, S_l, d]
  }
  at::Tensor h = hidden + attention;
  at::Tensor y = post_attention_layernorm(h);
  return h + down_proj(at::silu(gate_proj(y)) * up_proj(y));  // [B, S_l, d]
}

// ---------------------------------------------------------------------------------------------
DecoderLmImpl::DecoderLmImpl(const DecoderConfig& config, at::ScalarType dtype, uint64_t seed) : config_(config) {
  config_.validate();
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const int64_t d = config_.attention.hidden_size;
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(config_.vocab_size, d));
  torch::nn::ModuleList list;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    layers.emplace_back(config_, options);
    list->push_back(layers.back());
  }
  register_module("layers", list);
  norm = register_module("norm", RmsNorm(d, config_.attention.rms_norm_eps, options));
  lm_head = register_module("lm_head", linear(d, config_.vocab_size));
  initialise(seed);
  to(dtype);
}

void DecoderLmImpl::initialise(uint64_t seed) {
  // device: initialised on the host: the same values on every rank and device
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ull + 29);
  const double residual_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(config_.num_layers));
  at::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    if (ends_with(name, "norm.weight")) {  // every RMSNorm (also the attention's latent norms)
      p.fill_(1.0);
    } else if (ends_with(name, ".bias")) {
      p.zero_();
    } else if (name == "embed_tokens.weight") {
      p.copy_(at::randn(p.sizes(), generator, p.options()));
    } else {
      double scale = 1.0 / std::sqrt(static_cast<double>(p.size(1)));  // fan-in
      if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight")) scale *= residual_scale;
      p.copy_(at::randn(p.sizes(), generator, p.options()) * scale);
    }
  }
}

at::Tensor DecoderLmImpl::forward(const at::Tensor& tokens, const std::vector<std::vector<int64_t>>& document_ends) {
  MLACP_REQUIRE(tokens.dim() == 2 && static_cast<int64_t>(document_ends.size()) == tokens.size(0), "decoder forward",
                "tokens must be [B, S_local] with one document-ends list per row",
                {got("tokens.dim", tokens.dim()), got("rows", tokens.dim() > 0 ? tokens.size(0) : 0),
                 got("document_end_lists", document_ends.size())},
                "pass LocalBatch::tokens and LocalBatch::document_ends");
  std::vector<MlaForwardOptions> row_options(tokens.size(0));
  for (size_t b = 0; b < row_options.size(); ++b)
    if (!document_ends[b].empty()) row_options[b].document_ends = document_ends[b];
  at::Tensor h = embed_tokens(tokens);  // [B, S_l, d]
  for (auto& layer : layers) h = recompute_ ? recomputed_layer(layer, h, row_options) : layer(h, row_options);
  return lm_head(norm(h));  // [B, S_l, V]
}

void DecoderLmImpl::parallelize(const ParallelGroups& groups, const CpOptions& options) {
  for (auto& layer : layers) mlacp::parallelize(layer->self_attn, groups, options);
}

bool DecoderLmImpl::skips_tp_reduction(const std::string& name) {
  const std::string inner = attention_parameter(name);
  return inner.empty() || MlaAttentionImpl::skips_tp_reduction(inner);
}

bool DecoderLmImpl::is_tp_split(const std::string& name) {
  const std::string inner = attention_parameter(name);
  return !inner.empty() && MlaAttentionImpl::is_tp_sharded_parameter(inner);
}

}  // namespace mlacp::train
