#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "core/compat.h"
#include "core/device.h"
#include "core/format.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"

namespace mlacp::train {
namespace {

namespace fs = std::filesystem;
constexpr const char* kWhat = "train";

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t ulysses_of(const MeshShape& m) { return m.ulysses == 0 ? m.cp : m.ulysses; }

void check_optimizer(const OptimizerConfig& o) {
  MLACP_REQUIRE(std::isfinite(o.lr) && o.lr > 0.0, kWhat, "learning rate must be finite and > 0", {got("lr", o.lr)},
                "e.g. --lr 3e-3");
  MLACP_REQUIRE(o.beta1 >= 0.0 && o.beta1 < 1.0 && o.beta2 >= 0.0 && o.beta2 < 1.0, kWhat,
                "AdamW betas must lie in [0, 1)", {got("beta1", o.beta1), got("beta2", o.beta2)}, "e.g. 0.9, 0.95");
  MLACP_REQUIRE(std::isfinite(o.eps) && o.eps > 0.0, kWhat, "AdamW eps must be > 0", {got("eps", o.eps)}, "e.g. 1e-8");
  MLACP_REQUIRE(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0, kWhat, "weight decay must be >= 0",
                {got("weight_decay", o.weight_decay)}, "e.g. 0.1");
  MLACP_REQUIRE(o.warmup_steps >= 0, kWhat, "warmup steps must be >= 0", {got("warmup_steps", o.warmup_steps)}, "");
  MLACP_REQUIRE(std::isfinite(o.grad_clip) && o.grad_clip >= 0.0, kWhat, "gradient clip must be >= 0 (0 = off)",
                {got("grad_clip", o.grad_clip)}, "e.g. 1.0");
}

void check_resumable(const TrainConfig& c, const CheckpointMeta& meta) {
  const std::string dtype = dtype_name(c.dtype);
  MLACP_REQUIRE(meta.tp == c.mesh.tp && meta.model == c.model.describe() && meta.seq_len == c.seq_len &&
                    meta.batch == c.batch && meta.dtype == dtype && meta.seed == c.seed,
                kWhat, "the checkpoint does not match this run (tp, model, seq, batch, dtype and seed must be equal)",
                {got("checkpoint", c.checkpoint_dir), got("checkpoint.tp", meta.tp), got("tp", c.mesh.tp),
                 got("checkpoint.model", meta.model), got("model", c.model.describe()),
                 got("checkpoint.seq", meta.seq_len), got("seq", c.seq_len), got("checkpoint.batch", meta.batch),
                 got("batch", c.batch), got("checkpoint.dtype", meta.dtype), got("dtype", dtype),
                 got("checkpoint.seed", meta.seed), got("seed", c.seed)},
                "resume with the settings of the run that wrote it (dp, cp, strategy and partition may change)");
  MLACP_REQUIRE(meta.step <= c.steps, kWhat, "the checkpoint is already past the last step",
                {got("checkpoint.step", meta.step), got("steps", c.steps)}, "raise --steps to continue training");
}

// A shard of generation `meta` that cannot be used: an error of kind fault naming it, with the
// previous complete generation as the way out (looked up only now: the folder scan reads every
// generation's meta.json).
[[noreturn]] void fail_damaged_shard(const std::string& checkpoint_dir, const CheckpointMeta& meta,
                                     const std::string& file, const std::string& rule, std::vector<ErrorValue> values) {
  std::string way = "resume from an earlier complete checkpoint";
  for (const CheckpointMeta& g : complete_generations(checkpoint_dir))
    if (g.step < meta.step)
      way = "remove " + meta.folder + " to resume from " + g.folder + " (step " + std::to_string(g.step) + ")";
  values.insert(values.begin(), got("file", file));
  fail_fault(kWhat, rule, std::move(values), way);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
double OptimizerConfig::lr_at(int64_t step) const {
  if (warmup_steps <= 0 || step >= warmup_steps) return lr;
  return lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
}

std::string TrainConfig::describe() const {
  std::ostringstream out;
  out << model.describe() << " | dp=" << mesh.dp << " cp=" << mesh.cp << " tp=" << mesh.tp
      << " ulysses=" << ulysses_of(mesh) << " strategy=" << strategy_name(strategy)
      << " partition=" << partition_name(partition) << " overlap=" << (overlap ? "on" : "off")
      << " recompute=" << (recompute ? "on" : "off") << (kv_recompute ? " kv_recompute=on" : "")
      << " | dtype=" << dtype_name(dtype) << " S=" << seq_len << " batch=" << batch << " steps=" << steps
      << " lr=" << optimizer.lr << " warmup=" << optimizer.warmup_steps << " clip=" << optimizer.grad_clip
      << " wd=" << optimizer.weight_decay << " seed=" << seed;
  if (!hf_checkpoint.empty()) out << " | hf_checkpoint=" << hf_checkpoint;
  // device: the CPU is the default and is not named
  if (!device.is_cpu()) out << " | device=" << device.type();
  return out.str();
}

std::string StepRecord::to_json() const {
  nlohmann::json j{{"step", step},         {"loss", loss},   {"tokens_per_s", tokens_per_second},
                   {"grad_norm", grad_norm}, {"lr", lr},     {"tokens", tokens},
                   {"step_s", step_seconds}, {"time_s", elapsed_seconds}};
  return j.dump();
}

StepRecord StepRecord::from_json(const std::string& line) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  MLACP_REQUIRE(j.is_object() && j.contains("step") && j.contains("loss") && j.at("step").is_number_integer() &&
                    j.at("loss").is_number(),
                "training log", "each line must be a JSON object with an integer step and a numeric loss",
                {got("line", line.substr(0, 120))}, "pass a log written by mlacp train --log");
  for (const char* field : {"tokens_per_s", "grad_norm", "lr", "tokens", "step_s", "time_s"})
    MLACP_REQUIRE(!j.contains(field) || j.at(field).is_number(), "training log", "step record fields must be numbers",
                  {got("field", field), got("line", line.substr(0, 120))}, "pass a log written by mlacp train --log");
  StepRecord r;
  r.step = j.at("step").get<int64_t>();
  r.loss = j.at("loss").get<double>();
  r.tokens_per_second = j.value("tokens_per_s", 0.0);
  r.grad_norm = j.value("grad_norm", 0.0);
  r.lr = j.value("lr", 0.0);
  r.tokens = j.value("tokens", int64_t{0});
  r.step_seconds = j.value("step_s", 0.0);
  r.elapsed_seconds = j.value("time_s", 0.0);
  return r;
}

double loss_agreement_tolerance(at::ScalarType dtype) {
  if (dtype == at::kDouble) return kLossAgreementFloat64;
  if (dtype == at::kFloat) return kLossAgreementFloat32;
  return kLossAgreementBf16;
}

double max_relative_loss_difference(const std::vector<StepRecord>& run, const std::vector<StepRecord>& reference,
                                    int64_t* common) {
  std::map<int64_t, double> by_step;
  for (const auto& r : reference) by_step[r.step] = r.loss;
  double worst = 0.0;
  int64_t count = 0;
  for (const auto& r : run) {
    const auto it = by_step.find(r.step);
    if (it == by_step.end()) continue;
    ++count;
    const double diff = std::abs(r.loss - it->second) / std::max(std::abs(it->second), 1e-300);
    worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);
  }
  if (common) *common = count;
  return count == 0 ? INFINITY : worst;
}

std::vector<StepRecord> read_step_log(const std::string& path, bool drop_torn_last_line) {
  std::ifstream in(path, std::ios::binary);
  MLACP_REQUIRE(in.good(), "training log", "the log file must exist and be readable", {got("path", path)},
                "pass a log written by mlacp train --log FILE.jsonl");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<StepRecord> records;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = text.find('\n', begin);
    const std::string line = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    begin = end == std::string::npos ? text.size() : end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (end == std::string::npos && drop_torn_last_line) {  // written up to a kill: no newline yet
      try {
        records.push_back(StepRecord::from_json(line));
      } catch (const Error&) {
      }
      continue;
    }
    records.push_back(StepRecord::from_json(line));
  }
  return records;
}

MemoryEstimate training_memory(const TrainConfig& config) {
  // A step's peak is the larger of two moments (docs/DESIGN.md §8, "Training"): the loss's backward
  // begins (every layer's saved activations, or only its input under --recompute, and the logits'
  // buffers) or a layer's backward runs (what the layers before it keep, its own activations, again
  // under --recompute, and the gradients its backward makes). Parameters, their gradients and
  // AdamW's state live throughout.
  const DecoderConfig& model = config.model;
  const MlaConfig& attention = model.attention;
  const double e = config.dtype == at::kDouble ? 8.0 : 4.0;  // bf16: float32 parameters and activations
  double parameters = 0;
  for (const auto& [name, shape] : decoder_parameter_shapes(model)) {
    double n = 1;
    for (int64_t d : shape) n *= static_cast<double>(d);
    parameters += n;
  }
  MemoryEstimate m;
  // Parameters, gradients, AdamW's exp_avg and exp_avg_sq; a checkpoint's copy while one is written.
  const bool checkpoints = !config.checkpoint_dir.empty();
  m.add(checkpoints ? "parameters, gradients, optimizer state and a checkpoint's copy"
                    : "parameters, gradients and optimizer state",
        parameters * e * (checkpoints ? 5.0 : 4.0));
  LayerShape layer;
  layer.batch = config.batch / std::max<int64_t>(1, config.mesh.dp);
  layer.seq_len = config.seq_len;
  layer.hidden = attention.hidden_size;
  layer.q_latent = attention.q_lora_rank.has_value();
  layer.output_gate = attention.output_gate;
  layer.element_bytes = static_cast<int64_t>(e);
  layer.attention_bytes = config.dtype == at::kBFloat16 ? 2 : 0;  // exchanged and computed in bf16
  layer.activation_bytes = config.dtype == at::kBFloat16 ? 2 : 0;  // the GEMMs' bf16 outputs
  layer.backward = false;  // what the forward saves, once (the backward's own buffers: `working`)
  CpPlanSpec spec = plan_spec_for(attention, config.mesh, config.strategy, config.partition, config.overlap);
  spec.kv_recompute = config.kv_recompute;
  const CpPlan plan(spec);
  const MemoryEstimate forward = layer_memory(plan, layer);
  layer.backward = true;
  const MemoryEstimate both = layer_memory(plan, layer);
  const double tokens = static_cast<double>(layer.batch) * static_cast<double>(config.seq_len) /
                        static_cast<double>(std::max<int64_t>(1, config.mesh.cp));
  const double d = static_cast<double>(attention.hidden_size), L = static_cast<double>(model.num_layers);
  const double I = static_cast<double>(model.intermediate_size), V = static_cast<double>(model.vocab_size);
  double saved = 0, working = 0;  // per layer: saved for its backward; its backward's own buffers
  for (const auto& [name, bytes] : forward.parts)
    if (name == "activations") saved += bytes;
  for (const auto& [name, bytes] : both.parts)
    if (name != "parameters" && name != "activations") working = std::max(working, bytes);
  // SwiGLU and two RMSNorms: each norm keeps its input (it recomputes the rest in its backward) and
  // its consumers keep its output, under bf16 autocast as the bf16 copies the GEMMs make. SwiGLU
  // keeps four I-wide tensors (silu's input and output, up_proj's output, their product: bf16 under
  // autocast); three are counted, at the parameters' width. Counting four, float32 measured
  // 1.16-1.27x (over the bound: other parts, such as the attention module's output, which the
  // residual sum does not keep, are counted though not held at the peak), so the sum stays the model.
  const double norm_output_bytes = config.dtype == at::kBFloat16 ? 2.0 : e;
  const double mlp = tokens * (3.0 * I + 2.0 * d) * e + tokens * 2.0 * d * norm_output_bytes;
  saved += mlp;
  // TP: the hidden state's copy at the layer's TP entry and the o_proj partial sum's all-reduced copy.
  if (config.mesh.tp > 1) saved += 2.0 * tokens * d * e;
  // The gradients a layer's backward makes replace the activations it frees as it goes; beyond
  // them it holds the attention kernel's buffers and the residual stream's gradient (two copies).
  working += 2.0 * tokens * d * e;
  // The loss: log-softmax's output and, in its backward, the two gradients of [T, V] (the logits die
  // with the forward's scope); the final norm's input and output (the head's input; its bf16 copy
  // under autocast) and the hidden state's gradient.
  const double loss_phase = tokens * (3.0 * V + 2.0 * d) * e + tokens * d * norm_output_bytes;
  const double kept = config.recompute ? tokens * d * e * L : saved * L;  // held across the forward
  const double in_backward = kept + (config.recompute ? saved : 0.0) + working;
  if (kept + loss_phase >= in_backward) {
    m.add(config.recompute ? "layer inputs (all layers)" : "saved activations (all layers)", kept);
    m.add("logits, log-softmax and their gradients", loss_phase);
  } else {
    m.add(config.recompute ? "layer inputs (all layers)" : "saved activations (all layers)", kept);
    if (config.recompute) m.add("saved activations (one layer, recomputed)", saved);
    m.add("a layer's backward (its gradients and kernel buffers)", working);
  }
  return m;
}

PreparedTraining prepare_training(const TrainConfig& config, int64_t world_size) {
  PreparedTraining p;
  p.config = config;
  TrainConfig& c = p.config;
  MLACP_REQUIRE(c.dtype == at::kDouble || c.dtype == at::kFloat || c.dtype == at::kBFloat16, kWhat,
                "dtype must be float64, float32 or bfloat16 (autocast)", {got("dtype", dtype_name(c.dtype))},
                "pass --dtype float64|float32|bfloat16");
  c.model.validate();
  check_mesh_shape(c.mesh, world_size);  // dp * cp * tp == world, cp % ulysses == 0
  c.mesh.ulysses = ulysses_of(c.mesh);
  CpPlanSpec spec = plan_spec_for(c.model.attention, c.mesh, c.strategy, c.partition, c.overlap);
  spec.kv_recompute = c.kv_recompute;
  const CpPlan plan(spec);  // heads % (tp*U); kv_recompute only with the latent strategy
  MLACP_REQUIRE(c.seq_len > 0, kWhat, "sequence length must be > 0", {got("seq_len", c.seq_len)}, "pass --seq N");
  check_shardable(c.partition, c.seq_len, c.mesh.cp);
  MLACP_REQUIRE(c.batch >= 1 && c.batch % c.mesh.dp == 0, kWhat,
                "batch must be >= 1 and divisible by dp (each DP rank takes batch/dp sequences)",
                {got("batch", c.batch), got("dp", c.mesh.dp)}, "choose a batch that dp divides");
  MLACP_REQUIRE(c.steps >= 1, kWhat, "steps must be >= 1", {got("steps", c.steps)}, "pass --steps N");
  check_optimizer(c.optimizer);
  MLACP_REQUIRE(c.checkpoint_every >= 0, kWhat, "checkpoint interval must be >= 0",
                {got("checkpoint_every", c.checkpoint_every)}, "0 saves only after the last step");
  if (!c.hf_checkpoint.empty()) {  // checked before any data is read
    MLACP_REQUIRE(!c.resume, kWhat,
                  "--hf-checkpoint starts a new run from a HuggingFace checkpoint's weights: it cannot go with --resume",
                  {got("hf_checkpoint", c.hf_checkpoint), got("checkpoint", c.checkpoint_dir)},
                  "--resume continues from the training checkpoint in --checkpoint, which holds the parameters (and the "
                  "optimizer state and data position) that would replace the HuggingFace weights; to continue a run "
                  "that started from " + c.hf_checkpoint + ", resume it with --config " +
                      (fs::path(c.hf_checkpoint) / "config.json").string() + " --checkpoint DIR --resume");
    const DecoderConfig from_file = load_hf_decoder_config(c.hf_checkpoint);
    if (c.model != from_file) {
      std::vector<ErrorValue> values{got("hf_checkpoint", c.hf_checkpoint), got("model", c.model.describe()),
                                     got("checkpoint_model", from_file.describe())};
      if (c.model.describe() == from_file.describe())
        values.push_back(got("differs_in", "the attention's rope or norm settings"));
      fail(kWhat, "the model config must be the HuggingFace checkpoint's", values,
           "set TrainConfig::model = load_hf_decoder_config(folder) (mlacp train --hf-checkpoint does)");
    }
    p.hf_checkpoint.emplace(open_hf_checkpoint(c.hf_checkpoint));
    p.hf_init = check_hf_decoder_checkpoint(*p.hf_checkpoint, c.model);
  }
  MLACP_REQUIRE(!c.resume || !c.checkpoint_dir.empty(), kWhat, "--resume needs --checkpoint DIR", {got("resume", true)},
                "pass the folder of the checkpoint to continue from");
  MLACP_REQUIRE(!c.resume_fallback || c.resume, kWhat,
                "--resume-fallback says which generation --resume may take: it goes with --resume",
                {got("resume_fallback", true), got("resume", false)}, "add --resume, or drop --resume-fallback");
  if (c.corpus_path.empty()) c.corpus_path = default_corpus_path();
  p.data = std::make_shared<const PackedCorpus>(load_corpus(c.corpus_path), c.seq_len);
  if (c.resume) {
    p.resume_from = read_checkpoint_meta(c.checkpoint_dir, c.resume_fallback, &p.resume_passed_over);
    check_resumable(c, *p.resume_from);
  }
  return p;
}

// ---------------------------------------------------------------------------------------------
Trainer::Trainer(const TrainConfig& config, const ParallelGroups& groups)
    : Trainer(prepare_training(config, groups.world_info.size), groups) {}

Trainer::Trainer(PreparedTraining prepared, const ParallelGroups& groups)
    : config_(std::move(prepared.config)),
      data_(std::move(prepared.data)),
      groups_(groups),
      sampler_(*data_, config_.batch, config_.seed) {
  const MeshShape& m = config_.mesh;
  MLACP_REQUIRE(groups_.shape.dp == m.dp && groups_.shape.cp == m.cp && groups_.shape.tp == m.tp &&
                    ulysses_of(groups_.shape) == m.ulysses,
                kWhat, "the process groups must have the configured mesh shape",
                {got("groups", groups_.describe()), got("dp", m.dp), got("cp", m.cp), got("tp", m.tp),
                 got("ulysses", m.ulysses)},
                "create the groups with TrainConfig::mesh");
  at::manual_seed(config_.seed);
  const at::ScalarType param_dtype = config_.dtype == at::kBFloat16 ? at::kFloat : config_.dtype;
  model_ = DecoderLm(config_.model, param_dtype, config_.seed);  // same values on every rank
  if (prepared.hf_checkpoint) hf_init_ = load_hf_decoder_checkpoint(model_, *prepared.hf_checkpoint);  // before TP
  model_->to(config_.device);  // initialised on the host (the same values everywhere), trained on the device
  if (m.cp > 1 || m.tp > 1)
    model_->parallelize(groups_, {config_.strategy, config_.partition, config_.overlap, AttentionKernel::blockwise,
                                  config_.kv_recompute});
  model_->set_recompute(config_.recompute);
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& p : model_->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  const OptimizerConfig& o = config_.optimizer;
  auto options = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(o.lr_at(1))
                                                            .betas({o.beta1, o.beta2})
                                                            .eps(o.eps)
                                                            .weight_decay(weight_decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  param_groups.emplace_back(decay, options(o.weight_decay));
  param_groups.emplace_back(no_decay, options(0.0));
  optimizer_ = std::make_unique<torch::optim::AdamW>(param_groups, torch::optim::AdamWOptions(o.lr_at(1)));
  if (prepared.resume_from) load_checkpoint(*prepared.resume_from);
  started_ = now_seconds();
}

at::Tensor Trainer::forward_backward(const LocalBatch& local) {
  const bool bf16 = config_.dtype == at::kBFloat16;
  const at::ScalarType loss_dtype = config_.dtype == at::kDouble ? at::kDouble : at::kFloat;
  // The batch reaches the device from pinned memory, without a host synchronisation.
  const at::Tensor tokens = host_to_device(local.tokens, config_.device);
  const at::Tensor labels = host_to_device(local.labels, config_.device);
  at::Tensor loss;
  {
    std::unique_ptr<compat::AutocastGuard> autocast;
    if (bf16) autocast = std::make_unique<compat::AutocastGuard>(config_.device.type(), true, at::kBFloat16);
    at::Tensor logits = model_->forward(tokens, local.document_ends);  // [b, S_l, V]
    at::Tensor token_losses_sum =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(loss_dtype), labels.reshape({-1}), {},
                               at::Reduction::Sum, kIgnoreLabel);
    loss = token_losses_sum / static_cast<double>(local.global_label_count);  // docs/DESIGN.md §7: global normaliser
  }
  loss.backward();
  return loss.detach();
}

at::Tensor Trainer::clip_gradients() {
  at::NoGradGuard no_grad;
  // Squared norms in float64 on the parameters' device: [parameters whole on every rank,
  // parameters split over TP]. Nothing is read on the host here: the clip factor is applied as a
  // tensor (a GPU step never waits for it), the norm is read with the loss after the step.
  at::Tensor squares = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).device(config_.device));
  for (const auto& item : model_->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    if (g.defined()) squares[DecoderLmImpl::is_tp_split(item.key()) ? 1 : 0] += g.to(at::kDouble).pow(2).sum();
  }
  if (groups_.tp.size() > 1) {  // each TP rank holds other heads of the split parameters
    at::Tensor split = launch_all_reduce_sum(groups_.tp, squares.narrow(0, 1, 1), "grad_norm").wait_one();
    squares.narrow(0, 1, 1).copy_(split);
  }
  const at::Tensor norm = squares.sum().sqrt();
  const double max_norm = config_.optimizer.grad_clip;
  if (max_norm > 0.0) {
    // scale = max_norm / (norm + 1e-6) where norm > max_norm, else 1 (as before, now without a branch on the host)
    const at::Tensor scale = at::where(norm > max_norm, max_norm / (norm + 1e-6), at::ones_like(norm));
    std::map<at::ScalarType, at::Tensor> scale_in;  // the factor in each gradient dtype, cast once
    for (auto& p : model_->parameters()) {
      if (!p.grad().defined()) continue;
      at::Tensor& s = scale_in[p.grad().scalar_type()];
      if (!s.defined()) s = scale.to(p.grad().scalar_type());
      p.grad().mul_(s);
    }
  }
  return norm;
}

StepRecord Trainer::step(const std::function<void(const StepRecord&)>& recorded) {
  const double begin = now_seconds();
  StepRecord r;
  r.step = step_ + 1;
  const GlobalBatch batch = sampler_.next();
  const LocalBatch local = shard_batch(batch, config_.partition, config_.mesh.cp, groups_.cp_rank, config_.mesh.dp,
                                       groups_.dp_rank);
  MLACP_REQUIRE(local.global_label_count > 0, kWhat, "a batch has no token with a label",
                {got("step", r.step), got("seq_len", config_.seq_len)}, "use longer sequences or documents");
  optimizer_->zero_grad();
  at::Tensor loss = forward_backward(local);
  reduce_gradients(model_->named_parameters(), groups_, &DecoderLmImpl::skips_tp_reduction);  // docs/DESIGN.md §7
  const at::Tensor grad_norm = clip_gradients();
  r.lr = config_.optimizer.lr_at(r.step);
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(r.lr);
  optimizer_->step();
  at::Tensor global_loss = loss.to(at::kDouble).reshape({1});
  for (const CommGroup* g : {&groups_.cp, &groups_.dp})
    if (g->size() > 1) global_loss = launch_all_reduce_sum(*g, global_loss, "loss").wait_one();
  // The step is enqueued; its two numbers are read on the host once, here, after the optimizer.
  // device: the step's two numbers, read once after the optimizer
  const at::Tensor numbers = at::cat({global_loss, grad_norm.reshape({1})}).cpu();
  r.loss = numbers[0].item<double>();
  r.grad_norm = numbers[1].item<double>();
  // Every rank holds the same all-reduced loss and global gradient norm: all stop alike, before
  // a checkpoint of non-finite weights could be written.
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm))
    fail_fault(kWhat, "the training diverged: the loss or the gradient norm is not finite",
               {got("step", r.step), got("loss", r.loss), got("grad_norm", r.grad_norm), got("lr", r.lr)},
               "lower --lr (or lengthen --warmup), or clip gradients with --grad-clip");
  step_ = r.step;
  const double end = now_seconds();
  r.tokens = config_.batch * config_.seq_len;
  r.step_seconds = end - begin;
  r.tokens_per_second = r.step_seconds > 0.0 ? static_cast<double>(r.tokens) / r.step_seconds : 0.0;
  r.elapsed_seconds = end - started_;
  if (recorded) recorded(r);
  const bool due = config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0;
  if (!config_.checkpoint_dir.empty() && (due || done())) save_checkpoint();
  return r;
}

// ---------------------------------------------------------------------------------------------
void Trainer::save_checkpoint() {
  MLACP_REQUIRE(!config_.checkpoint_dir.empty(), kWhat, "saving a checkpoint needs a checkpoint folder", {},
                "pass --checkpoint DIR");
  const std::string& dir = config_.checkpoint_dir;
  const std::string partial = partial_folder(dir, step_);
  const bool leader = groups_.world_info.rank == 0;
  std::string problem;
  if (leader) problem = begin_generation(dir, step_);  // the folder's side of a save: checkpoint_folder.h
  barrier(groups_.world);
  MLACP_REQUIRE(fs::is_directory(partial), kWhat, "cannot create the checkpoint folder",
                {got("checkpoint", partial), got("error", problem.empty() ? "(on rank 0)" : problem)},
                "choose a writable path");
  if (groups_.dp_rank == 0 && groups_.cp_rank == 0) {  // one writer per TP shard
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive model_archive(archive.compilation_unit());
    torch::serialize::OutputArchive optimizer_archive(archive.compilation_unit());
    model_->save(model_archive);
    optimizer_->save(optimizer_archive);
    archive.write("model", model_archive);
    archive.write("optimizer", optimizer_archive);
    archive.write("step", at::tensor(step_, at::kLong));
    archive.write("data_position", at::tensor(sampler_.position(), at::kLong));
    archive.save_to(shard_file(partial, groups_.tp_rank, config_.mesh.tp));
  }
  barrier(groups_.world);
  if (leader) {  // meta.json last, then the switch, then the oldest generations go
    CheckpointMeta meta;
    meta.step = step_;
    meta.data_position = sampler_.position();
    meta.tp = config_.mesh.tp;
    meta.model = config_.model.describe();
    meta.seq_len = config_.seq_len;
    meta.batch = config_.batch;
    meta.dtype = dtype_name(config_.dtype);
    meta.seed = config_.seed;
    commit_generation(dir, meta, config_.describe());
  }
  barrier(groups_.world);
}

// Every problem found here is damage (kind fault, README "Exit codes"): read_checkpoint_meta found
// the generation complete and matching this run, so its shard's content is what is wrong.
void Trainer::load_checkpoint(const CheckpointMeta& meta) {
  const std::string file = shard_file(meta.folder, groups_.tp_rank, config_.mesh.tp);
  const auto damaged = [&](const std::string& rule, std::vector<ErrorValue> values) {
    fail_damaged_shard(config_.checkpoint_dir, meta, file, rule, std::move(values));
  };
  const auto first_line = [](const std::exception& e) {
    const std::string why = e.what();
    return why.substr(0, why.find('\n'));  // LibTorch's first line, not its stack trace
  };
  torch::serialize::InputArchive archive, model_archive, optimizer_archive;
  at::Tensor step, position;
  try {
    archive.load_from(file, config_.device);  // a checkpoint resumes on any device
    archive.read("step", step);
    archive.read("data_position", position);
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
  } catch (const std::exception& e) {
    damaged("a checkpoint shard cannot be read (corrupted, or not a checkpoint)", {got("error", first_line(e))});
  }
  if (step.numel() != 1 || position.numel() != 1) damaged("a checkpoint shard lacks its step record", {});
  if (step.item<int64_t>() != meta.step || position.item<int64_t>() != meta.data_position)
    damaged("checkpoint shard and meta.json disagree (a shard of another generation or run)",
            {got("shard.step", step.item<int64_t>()), got("meta.step", meta.step)});
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : model_->parameters()) shapes.push_back(p.sizes().vec());
  try {
    model_->load(model_archive);
  } catch (const std::exception& e) {
    damaged("checkpoint parameters do not fit the model its meta.json names", {got("error", first_line(e))});
  }
  size_t i = 0;
  for (const auto& item : model_->named_parameters()) {  // meta.json matched; this catches a foreign shard file
    if (item.value().sizes().vec() != shapes[i++])
      damaged("checkpoint parameter does not fit the model its meta.json names",
              {got("parameter", item.key()), got("loaded", shape_text(item.value()))});
  }
  try {
    optimizer_->load(optimizer_archive);
  } catch (const std::exception& e) {
    damaged("the checkpoint's optimizer state cannot be read", {got("error", first_line(e))});
  }
  step_ = meta.step;
  sampler_.set_position(meta.data_position);
}

}  // namespace mlacp::train
