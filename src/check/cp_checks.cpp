#include "check/cp_checks.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>

#include "check/compare.h"
#include "core/compat.h"
#include "core/format.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "verify";

bool is_frozen(const CpCase& c, const std::string& name) {
  for (const auto& prefix : c.frozen)
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

void freeze(const CpCase& c, MlaAttention& module) {
  for (auto& item : module->named_parameters())
    if (is_frozen(c, item.key())) item.value().set_requires_grad(false);
}

// Single-device forward + backward of the whole batch (every rank computes it) on `device`; the
// results come back to the CPU. The float64 oracle runs on the CPU; the single-device bf16 run
// whose error bounds a bf16 CP run's runs where the CP run does (its rounding is the device's).
ForwardBackward reference_run(const CpCase& c, at::ScalarType dtype, bool bf16_autocast,
                              // device: the float64 oracle runs on the CPU
                              const c10::Device& device = c10::Device(c10::DeviceType::CPU)) {
  MlaAttention module = make_case_module(c.base, dtype);
  module->set_attention_kernel(c.reference_kernel);
  freeze(c, module);
  module->to(device);
  const CaseInputs inputs = inputs_on(make_case_inputs(c.base, dtype), device);
  std::unique_ptr<compat::AutocastGuard> autocast;
  if (bf16_autocast) autocast = std::make_unique<compat::AutocastGuard>(device.type(), true, at::kBFloat16);
  ForwardBackward result = run_forward_backward(module, inputs);
  // device: results are compared on the CPU, with the oracle
  result.output = result.output.cpu();
  for (auto& [name, grad] : result.gradients) {
    if (grad.defined()) grad = grad.cpu();  // device: compared on the CPU
  }
  return result;
}

// The reference computed on world rank 0 only (float64, or float32 for float32 cases) and summed into zeros elsewhere (for
// sequences where every rank recomputing it would cost too much time and memory).
ForwardBackward shared_reference(const CpCase& c, const ParallelGroups& groups) {
  ForwardBackward reference;
  if (groups.world_info.rank == 0) {
    // float32 cases get a float32 reference here (a float64 one at these lengths takes too long).
    reference = reference_run(c, c.dtype == at::kFloat ? at::kFloat : at::kDouble, false);
    reference.output = reference.output.to(at::kDouble);
  } else {
    MlaAttention shapes = make_case_module(c.base, at::kDouble);
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    reference.output = at::zeros({c.base.batch, c.base.seq_len, c.base.config.hidden_size}, f64);
    reference.gradients.emplace_back("hidden", at::zeros_like(reference.output));
    for (const auto& item : shapes->named_parameters())
      reference.gradients.emplace_back(item.key(), at::zeros_like(item.value()));
  }
  const c10::Device device = groups.world.device();  // the backend moves tensors there (NCCL: the GPU)
  auto summed = [&](const at::Tensor& t) {
    // device: the shared oracle is summed on the backend's device and compared on the CPU
    return launch_all_reduce_sum(groups.world, t.to(device), "reference").wait_one().cpu();
  };
  reference.output = summed(reference.output);
  for (auto& [name, grad] : reference.gradients) grad = summed(grad);
  return reference;
}

// The TP-local slice of a full parameter gradient.
at::Tensor tp_slice(const std::string& name, const at::Tensor& full, const MlaConfig& c, int64_t tp_rank,
                    int64_t tp) {
  if (tp == 1 || !MlaAttentionImpl::is_tp_sharded_parameter(name)) return full;
  const int64_t heads = c.num_heads / tp;
  if (name == "o_proj.weight") return full.narrow(1, tp_rank * heads * c.v_head_dim, heads * c.v_head_dim);
  const int64_t rows = full.size(0) / tp;
  return full.narrow(0, tp_rank * rows, rows);
}

// Error of a CP quantity against the float64 reference, by dtype (docs/DESIGN.md §9).
double error_of(const at::Tensor& value, const at::Tensor& reference, at::ScalarType dtype) {
  if (dtype == at::kDouble) return max_abs_error(value, reference);
  if (dtype == at::kFloat) return max_rel_error(value, reference);
  return norm_rel_error(value, reference);
}

int64_t element_size(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : c10::elementSize(dtype); }

}  // namespace

std::string CpCase::describe() const {
  std::ostringstream out;
  const MlaConfig& cfg = base.config;
  out << name << ": dp=" << mesh.dp << " cp=" << mesh.cp << " tp=" << mesh.tp
      << " ulysses=" << (mesh.ulysses ? mesh.ulysses : mesh.cp) << " strategy=" << strategy_name(strategy)
      << " partition=" << partition_name(partition) << " overlap=" << (overlap ? "on" : "off")
      << " kernel=" << kernel_name(kernel) << (kv_recompute ? " kv_recompute=on" : "")
      << " reference=" << kernel_name(reference_kernel)
      << (reference_on_rank0 ? " reference_on=rank0" : "") << " dtype=" << dtype_name(dtype) << " B=" << base.batch << " S=" << base.seq_len
      << " causal=" << (base.causal.value_or(cfg.causal) ? "yes" : "no") << " heads=" << cfg.num_heads
      << " hidden=" << cfg.hidden_size << " Rq=" << (cfg.q_lora_rank ? std::to_string(*cfg.q_lora_rank) : "none")
      << " Rkv=" << cfg.kv_lora_rank << " Dn=" << cfg.qk_nope_head_dim << " Dr=" << cfg.qk_rope_head_dim
      << " Dv=" << cfg.v_head_dim << " gate=" << (cfg.output_gate ? "yes" : "no") << " seed=" << base.seed;
  if (!base.document_ends.empty()) out << " docs=" << got("", base.document_ends).value;
  if (base.band_width > 0) out << " band=" << base.band_width << " masked_rows=" << got("", base.masked_rows).value;
  if (base.weights) out << " weights=" << base.weights_source;
  if (!frozen.empty()) {
    out << " frozen=";
    for (const auto& f : frozen) out << f << ",";
  }
  return out.str();
}

// The parameter names of an MlaAttention with this config (as MlaAttentionImpl registers them).
std::vector<std::string> parameter_names(const MlaConfig& c) {
  std::vector<std::string> names;
  auto linear = [&](const std::string& name, bool bias) {
    names.push_back(name + ".weight");
    if (bias) names.push_back(name + ".bias");
  };
  if (c.q_lora_rank) {
    linear("q_a_proj", c.attention_bias);
    names.push_back("q_a_layernorm.weight");
    linear("q_b_proj", c.up_proj_bias);
  } else {
    linear("q_proj", c.attention_bias);
  }
  linear("kv_a_proj_with_mqa", c.attention_bias);
  names.push_back("kv_a_layernorm.weight");
  linear("kv_b_proj", c.up_proj_bias);
  if (c.output_gate) linear("o_gate_proj", c.attention_bias);
  linear("o_proj", c.attention_bias);
  return names;
}

void validate_cp_case(const CpCase& c, int64_t world_size) {
  check_mesh_shape(c.mesh, world_size);
  c.base.config.validate();
  const std::vector<std::string> names = parameter_names(c.base.config);
  for (const std::string& prefix : c.frozen) {
    bool matches = prefix == "hidden";
    for (const std::string& name : names) matches = matches || (!prefix.empty() && name.rfind(prefix, 0) == 0);
    std::string all;
    for (const std::string& name : names) all += (all.empty() ? "" : ",") + name;
    MLACP_REQUIRE(matches, kWhat, "a --frozen prefix must match a parameter of the layer (or be 'hidden')",
                  {got("frozen", prefix), got("parameters", all)}, "pass a prefix of one of the parameter names");
  }
  const bool all_frozen = is_frozen(c, "hidden") && std::all_of(names.begin(), names.end(), [&c](const std::string& n) {
                            return is_frozen(c, n);
                          });
  if (all_frozen) {
    std::string frozen;
    for (const std::string& prefix : c.frozen) frozen += (frozen.empty() ? "" : ",") + prefix;
    fail(kWhat,
         "at least one input or parameter must require a gradient (the check compares gradients; backward "
         "needs one): --frozen freezes the input and every parameter",
         {got("frozen", frozen)}, "leave 'hidden' or one parameter prefix out of --frozen");
  }
  // Packed documents are given by their ends: each after the previous one, the first after 0 (a
  // repeated end, or a leading 0, would be an empty document), the last at S.
  int64_t previous_end = 0;
  for (int64_t end : c.base.document_ends) {
    MLACP_REQUIRE(end > previous_end, kWhat,
                  "--doc-ends are the documents' ends: each greater than the one before (the first > 0), so no "
                  "document is empty",
                  {got("doc_ends", c.base.document_ends), got("empty_document_end", end)},
                  "drop the repeated end (or a leading 0), e.g. --doc-ends 16,32 for two documents of 16 tokens");
    previous_end = end;
  }
  MLACP_REQUIRE(c.base.document_ends.empty() || previous_end == c.base.seq_len, kWhat,
                "the last --doc-ends value must be the sequence length (the last document ends with it)",
                {got("doc_ends", c.base.document_ends), got("seq", c.base.seq_len)}, "end the list with S");
  MLACP_REQUIRE(c.base.batch % c.mesh.dp == 0, kWhat, "batch must be divisible by dp (each DP rank takes B/dp rows)",
                {got("batch", c.base.batch), got("dp", c.mesh.dp)}, "choose a batch that dp divides");
  MLACP_REQUIRE(c.dtype == at::kDouble || c.dtype == at::kFloat || c.dtype == at::kBFloat16, kWhat,
                "dtype must be float64, float32 or bfloat16", {got("dtype", dtype_name(c.dtype))}, "");
  CpPlanSpec spec = plan_spec_for(c.base.config, c.mesh, c.strategy, c.partition, c.overlap);
  spec.kernel = c.kernel;
  spec.kv_recompute = c.kv_recompute;
  CpPlan plan(spec);  // plan rules (kv_recompute: latent strategy, blockwise kernel)
  check_shardable(c.partition, c.base.seq_len, c.mesh.cp);
}

ParallelGroups& GroupCache::get(const MeshShape& shape) {
  const int64_t u = shape.ulysses == 0 ? shape.cp : shape.ulysses;
  for (auto& [built_shape, groups] : built_) {
    if (built_shape.dp == shape.dp && built_shape.cp == shape.cp && built_shape.tp == shape.tp &&
        built_shape.ulysses == u)
      return groups;
  }
  MeshShape key = shape;
  key.ulysses = u;
  built_.emplace_back(key, rendezvous_.groups(key, options_));  // a case's U = 0 is U = P, on any hosts
  return built_.back().second;
}

namespace {

// One CP forward + backward + docs/DESIGN.md §7 reduction on this rank, with the case's plan (overlap as given).
struct CpRun {
  at::Tensor output;                          // [B/dp, S_l, d]
  at::Tensor hidden_grad;                     // undefined when the input is frozen
  std::vector<std::pair<std::string, at::Tensor>> param_grads;  // TP-local, after reduction
  CommCounters forward_counts, total_counts;
};

CpRun run_cp_once(const CpCase& c, ParallelGroups& groups, bool overlap,
                  const std::function<at::Tensor(const at::Tensor&)>& mine) {
  const bool bf16 = c.dtype == at::kBFloat16;
  const at::ScalarType param_dtype = bf16 ? at::kFloat : c.dtype;
  const c10::Device device = groups.world.device();  // where this rank's tensors live
  MlaAttention module = make_case_module(c.base, param_dtype);
  freeze(c, module);
  module->to(device);
  parallelize(module, groups, {c.strategy, c.partition, overlap, c.kernel, c.kv_recompute});
  CaseInputs global = inputs_on(make_case_inputs(c.base, param_dtype), device);
  at::Tensor hidden = mine(global.hidden).detach().clone().requires_grad_(!is_frozen(c, "hidden"));
  at::Tensor weight = mine(global.output_weight);
  CpRun run;
  groups.instruments.counters->reset();
  {
    std::unique_ptr<compat::AutocastGuard> autocast;
    if (bf16) autocast = std::make_unique<compat::AutocastGuard>(device.type(), true, at::kBFloat16);
    run.output = module->forward(hidden, global.options);
    run.forward_counts = *groups.instruments.counters;
    (run.output.to(at::kDouble) * weight.to(at::kDouble)).sum().backward();
  }
  run.total_counts = *groups.instruments.counters;
  reduce_gradients(module->named_parameters(), groups);
  // device: results are compared on the CPU, with the oracle
  run.output = run.output.detach().cpu();
  if (hidden.grad().defined()) run.hidden_grad = hidden.grad().cpu();  // device: compared on the CPU
  for (const auto& item : module->named_parameters()) {
    const at::Tensor& grad = item.value().grad();
    run.param_grads.emplace_back(item.key(), grad.defined() ? grad.cpu() : grad);  // device: compared on the CPU
  }
  return run;
}

}  // namespace

MemoryEstimate cp_case_memory(const CpCase& c, bool cp_run_on_device) {
  const MlaConfig& cfg = c.base.config;
  const auto bytes_of = [](at::ScalarType t) -> int64_t { return t == at::kDouble ? 8 : 4; };  // bf16: f32 masters
  LayerShape shape;
  shape.batch = c.base.batch / std::max<int64_t>(1, c.mesh.dp);
  shape.seq_len = c.base.seq_len;
  shape.hidden = cfg.hidden_size;
  shape.q_latent = cfg.q_lora_rank.has_value();
  shape.output_gate = cfg.output_gate;
  shape.element_bytes = bytes_of(c.dtype);
  CpPlanSpec cp_spec = plan_spec_for(cfg, c.mesh, c.strategy, c.partition, c.overlap);
  cp_spec.kernel = c.kernel;
  cp_spec.kv_recompute = c.kv_recompute;
  const MemoryEstimate cp_run = cp_run_on_device ? MemoryEstimate{} : layer_memory(CpPlan(cp_spec), shape);
  // The oracle: the whole batch on one rank with the reference's kernel, float64 (float32 for a
  // float32 case computed on rank 0 alone); a bf16 case also runs float32 under autocast.
  CpPlanSpec one_spec = plan_spec_for(cfg, MeshShape{1, 1, 1}, c.strategy, c.partition, false);
  one_spec.kernel = c.reference_kernel;
  const CpPlan one(one_spec);
  LayerShape whole = shape;
  whole.batch = c.base.batch;
  whole.element_bytes = c.reference_on_rank0 && c.dtype == at::kFloat ? 4 : 8;
  const double oracle_bytes = static_cast<double>(whole.element_bytes);
  MemoryEstimate oracle = layer_memory(one, whole);
  if (c.dtype == at::kBFloat16) {
    whole.element_bytes = 4;
    MemoryEstimate single_bf16 = layer_memory(one, whole);
    if (single_bf16.total() > oracle.total()) oracle = single_bf16;
  }
  // The phases run one after the other: the peak is the largest, plus the results kept between
  // them (the oracle's output in float64; its input, input gradient, parameters and their
  // gradients at the oracle's width).
  const double S = static_cast<double>(c.base.seq_len), B = static_cast<double>(c.base.batch);
  const double mask_build = c.base.band_width > 0 ? 17.0 * S * S : 0.0;  // (i - j).abs() < band in int64
  MemoryEstimate m;
  const MemoryEstimate& largest = oracle.total() >= cp_run.total() ? oracle : cp_run;
  if (mask_build > largest.total()) m.add("band mask (built)", mask_build);
  else m.add(largest, 1.0, &largest == &oracle ? "oracle " : "CP run ");
  const double params = layer_parameter_elements(one, whole);
  const double tokens = B * S * static_cast<double>(cfg.hidden_size);
  m.add("kept results", tokens * 8.0 + (2.0 * tokens + 2.0 * params) * oracle_bytes +
                            (c.base.band_width > 0 ? S * S : 0.0));
  return m;
}

std::vector<CheckRow> run_cp_case(const CpCase& c, ParallelGroups& groups) {
  validate_cp_case(c, groups.world_info.size);
  const MlaConfig& cfg = c.base.config;
  const bool bf16 = c.dtype == at::kBFloat16;
  const bool hidden_frozen = is_frozen(c, "hidden");

  ForwardBackward reference = c.reference_on_rank0 ? shared_reference(c, groups) : reference_run(c, at::kDouble, false);
  ForwardBackward single_bf16;
  if (bf16) single_bf16 = reference_run(c, at::kFloat, true, groups.world.device());

  // This rank's rows: batch rows of its DP rank, tokens of its CP rank.
  const int64_t local_batch = c.base.batch / c.mesh.dp;
  auto mine = [&](const at::Tensor& global) {  // on the tensor's own device
    return shard_sequence(global.narrow(0, groups.dp_rank * local_batch, local_batch), c.partition, c.mesh.cp,
                          groups.cp_rank);
  };
  const CpRun run = run_cp_once(c, groups, c.overlap, mine);
  const CpPlan plan(plan_spec_for(cfg, groups.shape, c.strategy, c.partition, c.overlap));
  const at::Tensor& output = run.output;
  const CommCounters& forward_counts = run.forward_counts;
  const CommCounters& total_counts = run.total_counts;

  // Errors, in row order: output, input grad, parameter grads, frozen contract, bytes.
  std::vector<double> errors, tolerances;
  std::vector<std::string> names;
  auto add = [&](const std::string& quantity, double error, double tolerance) {
    names.push_back(quantity);
    errors.push_back(std::isnan(error) ? std::numeric_limits<double>::infinity() : error);
    tolerances.push_back(tolerance);
  };
  const double tol = c.dtype == at::kDouble ? kCpFloat64Tolerance : kCpFloat32Tolerance;
  auto bf16_tolerance = [&](const at::Tensor& single, const at::Tensor& ref) {
    return kCpBf16Factor * std::max(norm_rel_error(single, ref), 1e-6);
  };
  add("output", error_of(output, mine(reference.output), c.dtype),
      bf16 ? bf16_tolerance(single_bf16.output, reference.output) : tol);
  std::map<std::string, at::Tensor> ref_grads(reference.gradients.begin(), reference.gradients.end());
  std::map<std::string, at::Tensor> bf16_grads(single_bf16.gradients.begin(), single_bf16.gradients.end());
  if (!hidden_frozen) {
    add("grad hidden", error_of(run.hidden_grad, mine(ref_grads["hidden"]), c.dtype),
        bf16 ? bf16_tolerance(bf16_grads["hidden"], ref_grads["hidden"]) : tol);
  }
  double param_error = 0.0, param_tolerance = bf16 ? 0.0 : tol, frozen_violations = 0.0;
  for (const auto& [name, grad] : run.param_grads) {
    if (is_frozen(c, name)) {
      frozen_violations += grad.defined() ? 1.0 : 0.0;
      continue;
    }
    const at::Tensor ref = tp_slice(name, ref_grads[name], cfg, groups.tp_rank, c.mesh.tp);
    param_error = std::max(param_error, grad.defined() ? error_of(grad, ref, c.dtype) : INFINITY);
    if (bf16) {
      param_tolerance = std::max(param_tolerance,
                                 bf16_tolerance(tp_slice(name, bf16_grads[name], cfg, groups.tp_rank, c.mesh.tp), ref));
    }
  }
  add("grad params (worst)", param_error, param_tolerance);
  if (!c.frozen.empty()) add("frozen params have no grad", frozen_violations, 0.0);
  if (c.frozen.empty() && c.mesh.dp == 1) {
    const CommVolume v = expected_comm_elements(plan, local_batch, c.base.seq_len);
    const int64_t es = element_size(c.dtype), wide = bf16 ? 4 : es;
    auto bytes = [](const CommCounters& counts, CollectiveKind kind) {
      return static_cast<double>(counts.by_kind(kind).bytes);
    };
    const double fwd_a2a = bytes(forward_counts, CollectiveKind::all_to_all);
    const double fwd_gather = bytes(forward_counts, CollectiveKind::all_gather);
    const double bwd_a2a = bytes(total_counts, CollectiveKind::all_to_all) - fwd_a2a;
    const double bwd_rs = bytes(total_counts, CollectiveKind::reduce_scatter);
    add("bytes fwd |measured-formula|",
        std::abs(fwd_a2a - (v.forward_all_to_all + v.forward_output) * es) +
            std::abs(fwd_gather - v.forward_all_gather * es),
        0.0);
    add("bytes bwd |measured-formula|",
        std::abs(bwd_a2a - v.backward_all_to_all * es) + std::abs(bwd_rs - v.backward_reduce * wide), 0.0);
  }
  if (c.overlap && c.mesh.cp > 1) {
    // The overlap schedule against the plain one, on the same ranks (docs/DESIGN.md §5: identical results).
    const CpRun plain = run_cp_once(c, groups, false, mine);
    double diff = max_abs_error(run.output, plain.output);
    if (run.hidden_grad.defined()) diff = std::max(diff, max_abs_error(run.hidden_grad, plain.hidden_grad));
    for (size_t i = 0; i < run.param_grads.size(); ++i) {
      const at::Tensor& a = run.param_grads[i].second;
      const at::Tensor& b = plain.param_grads[i].second;
      if (a.defined() != b.defined()) diff = INFINITY;
      else if (a.defined()) diff = std::max(diff, max_abs_error(a, b));
    }
    add("overlap on vs off (max abs)", diff, kOverlapTolerance);
  }
  // Same rows on every rank: worst error over the world.
  errors = all_reduce_max(groups.world, errors);
  tolerances = all_reduce_max(groups.world, tolerances);
  std::vector<CheckRow> rows;
  for (size_t i = 0; i < names.size(); ++i) rows.push_back({c.name, names[i], errors[i], tolerances[i]});
  return rows;
}

}  // namespace mlacp
