#include "check/cases.h"

#include <set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "mlacp/errors.h"

namespace mlacp {

MlaAttention make_case_module(const VerifyCase& c, at::ScalarType dtype) {
  // device: draws on the host, so every device gets the same values
  auto generator = at::make_generator<at::CPUGeneratorImpl>(c.seed + 17);
  MlaAttention module(c.config, at::TensorOptions().dtype(at::kFloat));
  at::NoGradGuard no_grad;
  // Given weights are copied after the cast, so a float64 module holds them exactly.
  for (auto& item : module->named_parameters()) {
    if (c.weights) continue;
    at::Tensor p = item.value();
    if (item.key().find("layernorm") != std::string::npos) {
      p.copy_(1.0 + 0.2 * at::randn(p.sizes(), generator, p.options()));
    } else {
      const double fan_in = p.dim() == 2 ? static_cast<double>(p.size(1)) : 4.0;
      p.copy_(at::randn(p.sizes(), generator, p.options()) / std::sqrt(fan_in));
    }
  }
  module->to(dtype);
  if (c.weights) {
    auto parameters = module->named_parameters();
    std::set<std::string> names, expected;
    for (const auto& [name, value] : *c.weights) names.insert(name);
    for (const std::string& name : parameters.keys()) expected.insert(name);
    MLACP_REQUIRE(names == expected && names.size() == c.weights->size(), "verify",
                  "the case's weights must be exactly the layer's parameters",
                  {got("weights", c.weights_source), got("count", c.weights->size()),
                   got("parameters", parameters.size())},
                  "load them with HfCheckpoint::read_attention_layer for the same config");
    for (const auto& [name, value] : *c.weights) {
      at::Tensor p = parameters[name];
      MLACP_REQUIRE(p.sizes() == value.sizes(), "verify", "a weight's shape differs from its parameter's",
                    {got("parameter", name), got("shape", value.sizes().vec()), got("expected", p.sizes().vec())},
                    "load the weights for the same config");
      p.copy_(value);  // converts to the module's dtype
    }
  }
  // A case module is an oracle: its single-device path runs the reference kernel (CP runs use
  // their plan's kernel).
  module->set_attention_kernel(AttentionKernel::reference);
  return module;
}

at::Tensor make_band_mask(int64_t seq_len, int64_t band_width, const std::vector<int64_t>& masked_rows) {
  at::Tensor i = at::arange(seq_len).unsqueeze(1);
  at::Tensor j = at::arange(seq_len).unsqueeze(0);
  at::Tensor mask = (i - j).abs() < band_width;  // [S, S]
  for (int64_t row : masked_rows) mask[row].fill_(false);
  return mask.view({1, 1, seq_len, seq_len});
}

CaseInputs make_case_inputs(const VerifyCase& c, at::ScalarType dtype) {
  // device: draws on the host, so every device gets the same values
  auto generator = at::make_generator<at::CPUGeneratorImpl>(c.seed + 101);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  CaseInputs in;
  in.hidden = at::randn({c.batch, c.seq_len, c.config.hidden_size}, generator, f32).to(dtype);
  in.output_weight = at::randn({c.batch, c.seq_len, c.config.hidden_size}, generator, f32).to(dtype);
  in.options.is_causal = c.causal;
  if (!c.document_ends.empty()) in.options.document_ends = c.document_ends;
  if (c.band_width > 0) in.options.attention_mask = make_band_mask(c.seq_len, c.band_width, c.masked_rows);
  return in;
}

CaseInputs inputs_on(const CaseInputs& in, const c10::Device& device) {
  CaseInputs out = in;
  out.hidden = in.hidden.to(device);
  out.output_weight = in.output_weight.to(device);
  if (in.options.attention_mask.defined()) out.options.attention_mask = in.options.attention_mask.to(device);
  if (in.options.position_ids.defined()) out.options.position_ids = in.options.position_ids.to(device);
  if (in.options.position_embeddings) {
    out.options.position_embeddings = std::make_pair(in.options.position_embeddings->first.to(device),
                                                     in.options.position_embeddings->second.to(device));
  }
  return out;
}

std::vector<VerifyCase> default_single_device_cases() {
  const MlaConfig tiny = preset_config("tiny");
  std::vector<VerifyCase> cases;
  cases.push_back({"tiny-causal", tiny});
  {
    VerifyCase c{"tiny-noncausal-interleaved", tiny};
    c.causal = false;
    c.config.rope_layout = RopeLayout::interleaved;
    cases.push_back(c);
  }
  {
    VerifyCase c{"tiny-gate", tiny};
    c.config.output_gate = true;
    cases.push_back(c);
  }
  {
    VerifyCase c{"tiny-packed", tiny};
    c.batch = 1;
    c.seq_len = 11;
    c.document_ends = {3, 7, 11};
    cases.push_back(c);
  }
  {
    VerifyCase c{"tiny-band-masked-row", tiny};
    c.causal = false;
    c.band_width = 3;
    c.masked_rows = {4};
    cases.push_back(c);
  }
  {
    // DeepSeek-V2-Lite structure in small: no q latent, YaRN, every bias.
    VerifyCase c{"tiny-noqlatent-yarn-bias", tiny};
    c.config.q_lora_rank = std::nullopt;
    c.config.yarn = YarnScaling{4.0, 8, 32.0, 1.0, 0.707, 0.707};
    c.config.attention_bias = true;
    c.config.up_proj_bias = true;
    c.config.rope_layout = RopeLayout::interleaved;
    cases.push_back(c);
  }
  return cases;
}

VerifyCase find_case(const std::string& name) {
  for (const VerifyCase& c : default_single_device_cases())
    if (c.name == name) return c;
  std::string names;
  for (const VerifyCase& c : default_single_device_cases()) names += (names.empty() ? "" : ", ") + c.name;
  throw Error("verify", "unknown case name", {got("case", name)}, "choose one of " + names);
}

}  // namespace mlacp
