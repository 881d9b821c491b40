#include "mlacp/attention.h"
#include "model/mla_layer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/format.h"
#include "kernels/attend.h"
#include "kernels/rope.h"
#include "mlacp/errors.h"
#include "model/forward_inputs.h"
#include "model/rope_settings.h"

namespace mlacp {

// ---------------------------------------------------------------------------------------------
RmsNormImpl::RmsNormImpl(int64_t dim, double eps_, const at::TensorOptions& options, bool always_float32_)
    : eps(eps_), always_float32(always_float32_) {
  weight = register_parameter("weight", at::ones({dim}, options));
}

at::Tensor RmsNormImpl::normalise(const at::Tensor& x, const at::Tensor& weight, double eps, bool always_float32) {
  // Normalise in at least float32 (DeepSeek's rule); the result keeps the input's dtype, so
  // under autocast all three latents share one dtype.
  if (always_float32) {  // HuggingFace's order of operations, for bit-level parity with it
    at::Tensor xc = x.to(at::kFloat);
    at::Tensor normalised = xc * at::rsqrt(xc.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return (weight * normalised.to(x.scalar_type())).to(x.scalar_type());
  }
  const auto compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor xc = x.to(compute);
  at::Tensor normalised = xc * at::rsqrt(xc.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (weight.to(compute) * normalised).to(x.scalar_type());
}

at::Tensor RmsNormImpl::forward(const at::Tensor& x) {
  const bool x_grad = x.requires_grad(), weight_grad = weight.requires_grad();
  if (!at::GradMode::is_enabled() || (!x_grad && !weight_grad)) return normalise(x, weight, eps, always_float32);
  // Recomputed in the backward (docs/DESIGN.md §8, "What a step keeps"): LibTorch's graph of the
  // ops above would keep the input, the normalised input (for the weight's gradient) and, in the
  // consumer, the output: three [.., dim] tensors. This node keeps the input only; its backward
  // runs the same ops again with a graph and differentiates them, so the gradients are those
  // autograd gives the ops above, to the bit. The output is a fresh tensor its consumer may save.
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = normalise(x, weight, eps, always_float32);
  }
  const SavedForBackward saved({x.detach(), weight.detach()}, {"RMSNorm input", "RMSNorm weight"});
  const compat::AutocastSnapshot autocast = compat::AutocastSnapshot::capture(x.device().type());
  const double e = eps;
  const bool f32 = always_float32;
  BackwardFn backward = [saved, autocast, e, f32, x_grad, weight_grad](std::vector<at::Tensor> g) {
    saved.check("RMSNorm");
    const at::Tensor x_again = saved[0].detach().requires_grad_(x_grad);
    const at::Tensor w_again = saved[1].detach().requires_grad_(weight_grad);
    at::Tensor y;
    {
      at::AutoGradMode grad_on(true);
      const auto autocast_guard = autocast.enter();
      y = normalise(x_again, w_again, e, f32);
    }
    std::vector<at::Tensor> wrt;
    if (x_grad) wrt.push_back(x_again);
    if (weight_grad) wrt.push_back(w_again);
    std::vector<at::Tensor> grads = torch::autograd::grad({y}, wrt, {g[0]}, /*retain_graph=*/false,
                                                          /*create_graph=*/false, /*allow_unused=*/true);
    return std::vector<at::Tensor>{x_grad ? grads.front() : at::Tensor(), weight_grad ? grads.back() : at::Tensor()};
  };
  return attach_backward({x, weight}, {out}, "RMSNormBackward (recomputed)", std::move(backward))[0];
}

// ---------------------------------------------------------------------------------------------
struct MlaAttentionImpl::RopeState {
  RopeFrequencies frequencies;
};

namespace {

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

constexpr const char* kCore = "MLA attention core";

}  // namespace

MlaAttentionImpl::MlaAttentionImpl(const MlaConfig& config, const at::TensorOptions& options)
    : config_(config), local_heads_(config.num_heads), scaling_(config.scaling()) {
  config_.validate();
  const MlaConfig& c = config_;
  const int64_t h = local_heads_;
  if (c.q_lora_rank) {
    q_a_proj = register_module("q_a_proj", make_linear(c.hidden_size, *c.q_lora_rank, c.attention_bias));
    q_a_layernorm = register_module("q_a_layernorm", RmsNorm(*c.q_lora_rank, c.rms_norm_eps, options, c.rms_norm_float32));
    q_b_proj = register_module("q_b_proj", make_linear(*c.q_lora_rank, h * c.qk_head_dim(), c.up_proj_bias));
  } else {
    q_proj = register_module("q_proj", make_linear(c.hidden_size, h * c.qk_head_dim(), c.attention_bias));
  }
  kv_a_proj_with_mqa = register_module(
      "kv_a_proj_with_mqa", make_linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, c.attention_bias));
  kv_a_layernorm = register_module("kv_a_layernorm", RmsNorm(c.kv_lora_rank, c.rms_norm_eps, options, c.rms_norm_float32));
  kv_b_proj = register_module(
      "kv_b_proj", make_linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), c.up_proj_bias));
  if (c.output_gate) {
    o_gate_proj = register_module("o_gate_proj", make_linear(c.hidden_size, h * c.v_head_dim, c.attention_bias));
  }
  o_proj = register_module("o_proj", make_linear(h * c.v_head_dim, c.hidden_size, c.attention_bias));
  to(options.device(), options.dtype().toScalarType());
  rope_ = std::make_shared<RopeState>(RopeState{make_rope_frequencies(rope_settings(c))});
}

namespace {

// A module's own registry of parameters (torch::nn::Module::parameters_, protected): replacing a
// registered tensor by another object has no public LibTorch call, so it is reached here, once.
std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ",") + k;
  return out;
}

struct ParameterRegistry : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& module) {
    return module.*(&ParameterRegistry::parameters_);
  }
};

}  // namespace

void MlaAttentionImpl::adopt_parameters(const std::map<std::string, at::Tensor>& tensors) {
  constexpr const char* what = "adopt parameters";
  const auto own = named_parameters(/*recurse=*/true);
  for (const auto& [name, tensor] : tensors) {
    MLACP_REQUIRE(own.contains(name), what, "every given tensor must name a parameter of the module",
                  {got("name", name), got("parameters", join_keys(own.keys()))},
                  "check the config (q_lora_rank, attention_bias) matches the module the tensors come from");
  }
  const at::Tensor* first = nullptr;
  for (const auto& item : own) {
    auto it = tensors.find(item.key());
    MLACP_REQUIRE(it != tensors.end() && it->second.defined(), what, "every parameter of the module must be given",
                  {got("missing", item.key())}, "pass all of named_parameters()");
    const at::Tensor& t = it->second;
    MLACP_REQUIRE(t.sizes() == item.value().sizes(), what, "a given tensor must have the parameter's shape",
                  {got("name", item.key()), got("shape", shape_text(t)), got("expected", shape_text(item.value()))},
                  "check the config matches the module the tensors come from");
    if (!first) first = &t;
    MLACP_REQUIRE(t.scalar_type() == first->scalar_type() && t.device() == first->device(), what,
                  "all parameters must share one dtype and device",
                  {got("name", item.key()), got("dtype", dtype_name(t.scalar_type())),
                   got("first_dtype", dtype_name(first->scalar_type())), got("device", t.device()),
                   got("first_device", first->device())},
                  "move the whole module with .to() first");
  }
  // Once CP is installed its groups move tensors of the installed device (and its byte formulas
  // assume the dtype): tensors adopted later (a caller's per-forward parameters) must keep both.
  const at::Tensor& installed = own.begin()->value();
  MLACP_REQUIRE(!is_parallel() || (first->device() == installed.device() && first->scalar_type() == installed.scalar_type()),
                what, "parameters adopted after CP is installed must keep its device and dtype",
                {got("device", first->device()), got("installed_device", installed.device()),
                 got("dtype", dtype_name(first->scalar_type())), got("installed_dtype", dtype_name(installed.scalar_type()))},
                "move the parameters back, or build and parallelize a new module for the new device or dtype");
  for (auto& child : named_children()) {
    auto& registry = ParameterRegistry::of(*child.value());
    for (auto& entry : registry) {
      if (!entry.value().defined()) continue;
      entry.value() = tensors.at(child.key() + "." + entry.key());
    }
  }
  const auto& sub = tensors;
  auto linear = [&](torch::nn::Linear& l, const std::string& name) {
    if (!l) return;
    l->weight = sub.at(name + ".weight");
    if (l->bias.defined()) l->bias = sub.at(name + ".bias");
  };
  linear(q_a_proj, "q_a_proj");
  linear(q_b_proj, "q_b_proj");
  linear(q_proj, "q_proj");
  linear(kv_a_proj_with_mqa, "kv_a_proj_with_mqa");
  linear(kv_b_proj, "kv_b_proj");
  linear(o_proj, "o_proj");
  linear(o_gate_proj, "o_gate_proj");
  if (q_a_layernorm) q_a_layernorm->weight = sub.at("q_a_layernorm.weight");
  kv_a_layernorm->weight = sub.at("kv_a_layernorm.weight");
}

torch::nn::Linear& MlaAttentionImpl::query_up_projection() { return config_.q_lora_rank ? q_b_proj : q_proj; }

ResolvedForward MlaLayer::resolve(const MlaAttentionImpl& m, const at::Tensor& hidden,
                                  const MlaForwardOptions& options) {
  return resolve_forward_inputs(m.config_, hidden, options, m.is_training());
}

void MlaLayer::check_device(const MlaAttentionImpl& m, const at::Tensor& hidden) {
  MLACP_REQUIRE(!hidden.defined() || hidden.device() == m.o_proj->weight.device(), "MLA forward",
                "hidden states must be on the module's device", {got("hidden.device", hidden.device()),
                got("module.device", m.o_proj->weight.device())}, "move the input (or the module) with .to()");
}

at::Tensor MlaAttentionImpl::forward(const at::Tensor& hidden, const MlaForwardOptions& options) {
  MlaLayer::check_device(*this, hidden);
  if (core_) return core_->forward(*this, hidden, options);
  const ResolvedForward resolved = MlaLayer::resolve(*this, hidden, options);
  const LocalLatents latents = MlaLayer::compute_latents(*this, hidden);
  const at::Tensor attention = MlaLayer::single_device_core(*this, latents, resolved);  // [B, S, H*Dv]
  return MlaLayer::project_output(*this, attention, hidden);                              // [B, S, d]
}

std::string MlaAttentionImpl::parallel_description() const { return core_ ? core_->describe() : "single device"; }

LocalLatents MlaLayer::compute_latents(MlaAttentionImpl& m, const at::Tensor& hidden) {
  const MlaConfig& c = m.config_;
  LocalLatents latents;
  at::Tensor compressed = m.kv_a_proj_with_mqa(hidden);                                  // [B, S, Rkv+Dr]
  // split (not two narrows): its backward is one cat, not a zero-filled buffer per part.
  std::vector<at::Tensor> parts = compressed.split_with_sizes({c.kv_lora_rank, c.qk_rope_head_dim}, -1);
  latents.kv_latent = m.kv_a_layernorm(parts[0]);  // [B, S, Rkv]
  latents.key_rope_raw = parts[1];               // [B, S, Dr]
  // Without a q latent the hidden state is the query "latent"; under autocast it takes the
  // latents' dtype (q_proj would cast it anyway), so all three travel in one dtype.
  latents.query_latent = c.q_lora_rank ? m.q_a_layernorm(m.q_a_proj(hidden))             // [B, S, Rq|d]
                                       : hidden.to(compressed.scalar_type());
  return latents;
}

RopeTable MlaLayer::rope_table(const MlaAttentionImpl& m, const ResolvedForward& r) {
  if (r.rope_cos.defined()) return {r.rope_cos, r.rope_sin, m.rope_->frequencies.lanes};
  return rope_table(m, r.rope_positions);
}

RopeTable MlaLayer::rope_table(const MlaAttentionImpl& m, const at::Tensor& positions) {
  return make_rope_table(positions, m.rope_->frequencies);
}

at::Tensor MlaLayer::expand_query(MlaAttentionImpl& m, const at::Tensor& query_latent, const RopeTable& rope) {
  const MlaConfig& c = m.config_;
  at::Tensor q = m.query_up_projection()(query_latent);  // [B, S, H*Dqk]
  q = q.view({q.size(0), q.size(1), m.local_heads_, c.qk_head_dim()});  // [B, S, H, Dqk]
  std::vector<at::Tensor> parts = q.split_with_sizes({c.qk_nope_head_dim, c.qk_rope_head_dim}, -1);
  at::Tensor q_pe = apply_rope(parts[1], rope);
  return at::cat({parts[0], q_pe}, -1);  // [B, S, H, Dqk]
}

std::vector<at::Tensor> MlaLayer::kv_parameters(MlaAttentionImpl& m) {
  std::vector<at::Tensor> params{m.kv_b_proj->weight};
  if (m.kv_b_proj->bias.defined()) params.push_back(m.kv_b_proj->bias);
  return params;
}

std::vector<at::Tensor> MlaLayer::query_parameters(MlaAttentionImpl& m) {
  torch::nn::Linear& linear = m.query_up_projection();
  std::vector<at::Tensor> params{linear->weight};
  if (linear->bias.defined()) params.push_back(linear->bias);
  return params;
}

at::Tensor MlaLayer::rotate_key(const at::Tensor& key_rope_raw, const RopeTable& rope) {
  return apply_rope(key_rope_raw, rope);  // [B, S, Dr]
}

std::pair<at::Tensor, at::Tensor> MlaLayer::kv_up_rows(MlaAttentionImpl& m, int64_t head_begin, int64_t head_end) {
  const int64_t head_width = m.config_.qk_nope_head_dim + m.config_.v_head_dim;
  MLACP_REQUIRE(0 <= head_begin && head_begin < head_end && head_end <= m.local_heads_, kCore,
                "head range must lie inside kv_b_proj's heads",
                {got("head_begin", head_begin), got("head_end", head_end), got("heads", m.local_heads_)},
                "use [u*Hc, (u+1)*Hc) for Ulysses rank u");
  const int64_t heads = head_end - head_begin;
  // Slicing the parameter keeps its identity: the gradient lands in these rows only.
  at::Tensor weight = m.kv_b_proj->weight.narrow(0, head_begin * head_width, heads * head_width);
  at::Tensor bias;
  if (m.kv_b_proj->bias.defined()) bias = m.kv_b_proj->bias.narrow(0, head_begin * head_width, heads * head_width);
  return {weight, bias};
}

std::pair<at::Tensor, at::Tensor> MlaLayer::assemble_key_value(const MlaAttentionImpl& m, const at::Tensor& projected,
                                                               const at::Tensor& key_rope) {
  auto [key_nope, value] = split_key_value(m, projected);
  return {assemble_key(key_nope, key_rope), value};  // [B, S, h, Dqk], [B, S, h, Dv]
}

std::pair<at::Tensor, at::Tensor> MlaLayer::split_key_value(const MlaAttentionImpl& m, const at::Tensor& projected) {
  const MlaConfig& c = m.config_;
  const int64_t head_width = c.qk_nope_head_dim + c.v_head_dim;
  const int64_t heads = projected.size(2) / head_width;
  at::Tensor kv = projected.view({projected.size(0), projected.size(1), heads, head_width});  // [B, S, h, Dn+Dv]
  std::vector<at::Tensor> parts = kv.split_with_sizes({c.qk_nope_head_dim, c.v_head_dim}, -1);
  return {parts[0], parts[1]};
}

at::Tensor MlaLayer::assemble_key(const at::Tensor& key_nope, const at::Tensor& key_rope) {
  const auto& s = key_nope.sizes();  // [B, S, h, Dn]
  at::Tensor shared = key_rope.unsqueeze(2).expand({s[0], s[1], s[2], key_rope.size(-1)});  // [B, S, h, Dr]
  return at::cat({key_nope, shared.to(key_nope.scalar_type())}, -1);                       // [B, S, h, Dqk]
}

std::pair<at::Tensor, at::Tensor> MlaLayer::expand_key_value(MlaAttentionImpl& m, const at::Tensor& kv_latent,
                                                             const at::Tensor& key_rope, int64_t head_begin,
                                                             int64_t head_end) {
  const MlaConfig& c = m.config_;
  MLACP_REQUIRE(kv_latent.dim() == 3 && kv_latent.size(2) == c.kv_lora_rank && key_rope.dim() == 3 &&
                    key_rope.size(2) == c.qk_rope_head_dim && key_rope.size(0) == kv_latent.size(0) &&
                    key_rope.size(1) == kv_latent.size(1),
                kCore, "expand_key_value takes kv_latent [B, S, Rkv] and key_rope [B, S, Dr]",
                {got("kv_latent.shape", shape_text(kv_latent)), got("key_rope.shape", shape_text(key_rope)),
                 got("Rkv", c.kv_lora_rank), got("Dr", c.qk_rope_head_dim)},
                "pass the latents of compute_latents");
  auto [weight, bias] = kv_up_rows(m, head_begin, head_end);
  return assemble_key_value(m, at::linear(kv_latent, weight, bias), key_rope);  // [B, S, h, *]
}

void MlaAttentionImpl::validate_latents(const LocalLatents& l) const {
  const MlaConfig& c = config_;
  const std::pair<const at::Tensor*, const char*> all[] = {
      {&l.query_latent, "query_latent"}, {&l.kv_latent, "kv_latent"}, {&l.key_rope_raw, "key_rope_raw"}};
  for (const auto& [tensor, name] : all) {
    MLACP_REQUIRE(tensor->defined() && tensor->dim() == 3, kCore, std::string(name) + " must be 3-D [B, S, rank]",
            {got(std::string(name) + ".shape", shape_text(*tensor))}, "pass the outputs of compute_latents");
    MLACP_REQUIRE(tensor->numel() > 0, kCore, std::string(name) + " must not be empty",
            {got(std::string(name) + ".shape", shape_text(*tensor))}, "pass at least one token");
  }
  const at::Tensor& q = l.query_latent;
  for (const auto& [tensor, name] : all) {
    MLACP_REQUIRE(tensor->size(0) == q.size(0) && tensor->size(1) == q.size(1), kCore,
            "latents must share batch and sequence dims",
            {got("query_latent.shape", shape_text(q)), got(std::string(name) + ".shape", shape_text(*tensor))},
            "pass latents of the same tokens");
    MLACP_REQUIRE(tensor->scalar_type() == q.scalar_type(), kCore, "latents must share one dtype",
            {got("query_latent.dtype", dtype_name(q.scalar_type())),
             got(std::string(name) + ".dtype", dtype_name(tensor->scalar_type()))},
            "cast them to one dtype");
    MLACP_REQUIRE(tensor->device() == q.device(), kCore, "latents must be on one device",
            {got("query_latent.device", q.device()), got(std::string(name) + ".device", tensor->device())},
            "move them to one device");
  }
  const std::pair<int64_t, int64_t> widths[] = {
      {q.size(2), c.query_latent_dim()}, {l.kv_latent.size(2), c.kv_lora_rank}, {l.key_rope_raw.size(2), c.qk_rope_head_dim}};
  for (size_t i = 0; i < 3; ++i) {
    MLACP_REQUIRE(widths[i].first == widths[i].second, kCore, std::string(all[i].second) + " has the wrong width",
            {got("width", widths[i].first), got("expected", widths[i].second)}, "check the config");
  }
}

at::Tensor MlaLayer::single_device_core(MlaAttentionImpl& m, const LocalLatents& latents, const ResolvedForward& r) {
  m.validate_latents(latents);
  MLACP_REQUIRE(latents.query_latent.size(0) == r.batch && latents.query_latent.size(1) == r.seq_len, kCore,
                "latents must cover the resolved batch and sequence",
                {got("latents.shape", shape_text(latents.query_latent)), got("batch", r.batch),
                 got("seq_len", r.seq_len)},
                "resolve and compute the latents from the same hidden states");
  const MlaConfig& c = m.config_;
  const RopeTable rope = rope_table(m, r);
  at::Tensor query = expand_query(m, latents.query_latent, rope);  // [B, S, H, Dqk]
  at::Tensor key_rope = rotate_key(latents.key_rope_raw, rope);    // [B, S, Dr]
  auto [key, value] = expand_key_value(m, latents.kv_latent, key_rope, 0, m.local_heads_);
  AttentionStructure structure;
  structure.causal = r.causal;
  structure.query_token_index = r.local_tokens;
  structure.key_token_index = at::arange(r.seq_len, at::TensorOptions().dtype(at::kLong));  // host metadata
  structure.document_ends = r.document_ends;
  structure.mask = r.mask;
  at::Tensor out = attend(m.kernel_, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), m.scaling_,
                          structure);  // [B, H, S, Dv]
  return out.transpose(1, 2).reshape({r.batch, r.seq_len, m.local_heads_ * c.v_head_dim});  // [B, S, H*Dv]
}

at::Tensor MlaLayer::gate(MlaAttentionImpl& m, const at::Tensor& hidden) {
  return at::sigmoid(m.o_gate_proj(hidden));  // [B, S, H*Dv]
}

std::vector<at::Tensor> MlaLayer::gate_parameters(MlaAttentionImpl& m) {
  std::vector<at::Tensor> params{m.o_gate_proj->weight};
  if (m.o_gate_proj->bias.defined()) params.push_back(m.o_gate_proj->bias);
  return params;
}

at::Tensor MlaLayer::project_output(MlaAttentionImpl& m, const at::Tensor& attention, const at::Tensor& hidden,
                                    const std::function<at::Tensor(const at::Tensor&)>& reduce_partial) {
  at::Tensor gated = attention;                                       // [B, S, H*Dv]
  if (m.config_.output_gate) gated = attention * gate(m, hidden);
  if (!reduce_partial) return m.o_proj(gated);                        // [B, S, d]
  at::Tensor y = reduce_partial(at::linear(gated, m.o_proj->weight));  // row-parallel: sum over TP
  return m.o_proj->bias.defined() ? y + m.o_proj->bias : y;
}

void MlaLayer::install_core(MlaAttentionImpl& m, std::shared_ptr<AttentionCore> core) {
  MLACP_REQUIRE(!m.core_, "MLA attention", "a parallel runtime is already installed on this module",
                {got("installed", m.core_->describe())}, "install CP once per module; build a new module to change it");
  m.core_ = std::move(core);
}

const AttentionCore* MlaLayer::installed_core(const MlaAttentionImpl& m) { return m.core_.get(); }

bool MlaAttentionImpl::is_tp_sharded_parameter(const std::string& name) {
  for (const char* prefix : {"q_b_proj.", "q_proj.", "kv_b_proj.", "o_gate_proj."})
    if (name.rfind(prefix, 0) == 0) return true;
  return name == "o_proj.weight";
}

bool MlaAttentionImpl::skips_tp_reduction(const std::string& name) {
  return is_tp_sharded_parameter(name) || name == "o_proj.bias";
}

void MlaAttentionImpl::shard_heads_for_tp(int64_t tp_rank, int64_t tp_size) {
  const MlaConfig& c = config_;
  MLACP_REQUIRE(!core_, "tensor parallel", "shard heads before installing a parallel runtime",
                {got("installed", core_ ? core_->describe() : "")}, "call shard_heads_for_tp first");
  MLACP_REQUIRE(tp_size_ == 1, "tensor parallel", "heads are already sharded", {got("tp_size", tp_size_)},
                "shard a fresh module once");
  MLACP_REQUIRE(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size && c.num_heads % tp_size == 0,
                "tensor parallel", "heads must be divisible by tp and 0 <= tp_rank < tp",
                {got("heads", c.num_heads), got("tp_size", tp_size), got("tp_rank", tp_rank)},
                "choose tp dividing the head count");
  if (tp_size == 1) return;
  const int64_t heads = c.num_heads / tp_size, first = tp_rank * heads;
  at::NoGradGuard no_grad;
  auto keep_rows = [&](torch::nn::Linear& linear, int64_t width) {
    linear->weight.set_data(linear->weight.narrow(0, first * width, heads * width).clone());
    if (linear->bias.defined()) linear->bias.set_data(linear->bias.narrow(0, first * width, heads * width).clone());
  };
  keep_rows(query_up_projection(), c.qk_head_dim());
  keep_rows(kv_b_proj, c.qk_nope_head_dim + c.v_head_dim);
  if (c.output_gate) keep_rows(o_gate_proj, c.v_head_dim);
  o_proj->weight.set_data(o_proj->weight.narrow(1, first * c.v_head_dim, heads * c.v_head_dim).clone());
  local_heads_ = heads;
  tp_size_ = tp_size;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> mla_parameter_shapes(const MlaConfig& c) {
  // Mirrors the constructor's registration order (a test checks it against named_parameters()).
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  auto linear = [&](const std::string& name, int64_t in, int64_t out, bool bias) {
    shapes.push_back({name + ".weight", {out, in}});
    if (bias) shapes.push_back({name + ".bias", {out}});
  };
  const int64_t h = c.num_heads;
  if (c.q_lora_rank) {
    linear("q_a_proj", c.hidden_size, *c.q_lora_rank, c.attention_bias);
    shapes.push_back({"q_a_layernorm.weight", {*c.q_lora_rank}});
    linear("q_b_proj", *c.q_lora_rank, h * c.qk_head_dim(), c.up_proj_bias);
  } else {
    linear("q_proj", c.hidden_size, h * c.qk_head_dim(), c.attention_bias);
  }
  linear("kv_a_proj_with_mqa", c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, c.attention_bias);
  shapes.push_back({"kv_a_layernorm.weight", {c.kv_lora_rank}});
  linear("kv_b_proj", c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), c.up_proj_bias);
  if (c.output_gate) linear("o_gate_proj", c.hidden_size, h * c.v_head_dim, c.attention_bias);
  linear("o_proj", h * c.v_head_dim, c.hidden_size, c.attention_bias);
  return shapes;
}

}  // namespace mlacp
