// `mlacp bench`: step time and communication of each strategy with overlap off and on, on local
// ranks over an optional emulated link (docs/DESIGN.md §10). For each configuration: the median step
// (forward + backward) over --steps after --warmup, bytes per rank per collective kind next to
// the docs/DESIGN.md §4 formula, communication time, exposed communication (critical path: see
// bench_stats.h) and its fraction. For the transfers the schedule places under computation it
// reports how much was hidden with overlap on, and how much step time overlap saved against what
// those transfers cost when exposed (overlap off).
//   --auto-link sizes the link bandwidth, per strategy, so that each overlapped transfer takes at
//   most half of the computation placed under it (measured in a calibration run without a link).
#include <algorithm>
#include <cmath>
#include <array>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "bench_stats.h"
#include "check/cases.h"
#include "commands.h"
#include "memory_check.h"
#include "output_file.h"
#include "option_checks.h"
#include "plan_command.h"
#include "core/compat.h"
#include "core/device.h"
#include "core/format.h"
#include "core/memory_probe.h"
#include "core/timeline.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "table.h"

namespace mlacp::tools {
namespace {

using nlohmann::json;

// One step as this rank saw it.
struct RankStep {
  double step_us = 0;
  LabelTimes wait_us, gap_us;  // per label: time blocked in waits; launch to wait
  LabelTimes compute_us;       // per compute span name (summed over the step)
  std::map<std::string, int64_t> bytes;
  std::map<CollectiveKind, int64_t> bytes_by_kind;
  double peak_bytes = 0;  // tensor bytes the step allocated at its highest (core/memory_probe.h; CPU only)
  double peak_live_bytes = 0;  // the live tensor bytes at that moment, what was live before the step included
};

// The transfers the plan's overlapped schedule hides, by counter label (the schedule's own
// declaration, docs/DESIGN.md §5).
std::set<std::string> overlapped_labels(const CpPlan& plan, const MlaConfig& config, c10::DeviceType device) {
  std::set<std::string> labels;
  for (const OverlappedTransfer& t : overlapped_transfers(plan, config, device)) labels.insert(transfer_name(t.transfer));
  return labels;
}

RankStep run_step(MlaAttention& module, const at::Tensor& hidden, const at::Tensor& weight,
                  const MlaForwardOptions& options, ParallelGroups& groups, bool bf16) {
  groups.instruments.counters->reset();
  groups.instruments.timeline->clear();
  groups.instruments.timeline->set_enabled(true);
  const c10::Device device = hidden.device();
  barrier(groups.world);
  synchronize_device(device);
  const double start = Timeline::now_us();
  MemoryScope memory;  // host tensors: the probe counts the CPU allocator's storages
  {
    ComputeSpan span(groups.instruments.timeline.get(), "step");
    std::unique_ptr<compat::AutocastGuard> autocast;
    if (bf16) autocast = std::make_unique<compat::AutocastGuard>(device.type(), true, at::kBFloat16);
    at::Tensor y = module->forward(hidden, options);
    (y.to(at::kFloat) * weight).sum().backward();
  }
  synchronize_device(device);  // a GPU step is over when the device is done, not when it is enqueued
  RankStep s;
  s.step_us = Timeline::now_us() - start;
  s.peak_bytes = device.is_cpu() ? static_cast<double>(memory.peak_extra_bytes()) : 0.0;
  s.peak_live_bytes = static_cast<double>(memory.baseline_bytes()) + s.peak_bytes;
  groups.instruments.timeline->set_enabled(false);
  std::map<std::string, double> launched;
  for (const auto& e : groups.instruments.timeline->events()) {
    if (e.kind == EventKind::compute && e.name != "step") s.compute_us[e.name] += e.end_us - e.begin_us;
    if (e.kind == EventKind::launch) launched[e.name] = e.begin_us;
    if (e.kind == EventKind::wait) {
      s.wait_us[e.name] += e.end_us - e.begin_us;
      if (launched.count(e.name)) s.gap_us[e.name] += e.begin_us - launched[e.name];
    }
  }
  for (const auto& [label, totals] : groups.instruments.counters->by_label()) s.bytes[label] = totals.bytes;
  for (auto kind : {CollectiveKind::all_to_all, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                    CollectiveKind::all_reduce})
    s.bytes_by_kind[kind] = groups.instruments.counters->by_kind(kind).bytes;
  for (auto& item : module->parameters()) item.mutable_grad() = at::Tensor();
  return s;
}

// Combines one step over the ranks (after the step: not timed). Every rank runs the same
// schedule, so the labels agree.
StepSample combine(const RankStep& mine, const CommGroup& world) {
  std::vector<double> low, high{mine.step_us, mine.peak_bytes};
  for (const auto& [label, bytes] : mine.bytes) {
    const double wait = mine.wait_us.count(label) ? mine.wait_us.at(label) : 0.0;
    const double gap = mine.gap_us.count(label) ? mine.gap_us.at(label) : 0.0;
    low.insert(low.end(), {wait, gap});
    high.push_back(wait);
  }
  for (const auto& [name, us] : mine.compute_us) high.push_back(us);  // same spans on every rank
  low = all_reduce_min(world, low);
  high = all_reduce_max(world, high);
  StepSample s;
  s.step_us = high[0];
  s.peak_bytes = high[1];
  s.bytes = mine.bytes;
  for (const auto& [kind, bytes] : mine.bytes_by_kind) s.bytes_by_kind[collective_kind_name(kind)] = bytes;
  size_t i = 0;
  for (const auto& [label, bytes] : mine.bytes) {
    s.exposed_us[label] = low[2 * i];
    s.compute_under_us[label] = low[2 * i + 1];
    s.blocked_us[label] = high[2 + i];
    ++i;
  }
  for (const auto& [name, us] : mine.compute_us) s.compute_us[name] = high[2 + i++];
  return s;
}

int64_t bytes_of_kind(const std::vector<StepSample>& steps, CollectiveKind kind) {
  auto it = steps.front().bytes_by_kind.find(collective_kind_name(kind));
  return it == steps.front().bytes_by_kind.end() ? 0 : it->second;
}

json per_label_ms(const LabelTimes& us) {
  json out = json::object();
  for (const auto& [label, value] : us) out[label] = value / 1000.0;
  return out;
}

std::string joined(const std::set<std::string>& labels) {
  std::string names;
  for (const auto& l : labels) names += (names.empty() ? "" : ",") + l;
  return names;
}

// The plan bench runs for `strategy` (head_tail; --kv-recompute applies to the latent strategy).
CpPlanSpec bench_spec(const MlaConfig& cfg, const MeshShape& shape, CpStrategy strategy, const BenchArgs& a) {
  CpPlanSpec spec = plan_spec_for(cfg, shape, strategy, CpPartition::head_tail, true);
  spec.kv_recompute = a.kv_recompute && strategy == CpStrategy::latent_kv_head;
  return spec;
}

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchArgs& a) {
  CLI::App* cmd = app.add_subcommand("bench", "step time and exposed communication per strategy, overlap off/on");
  cmd->add_option("--nproc", a.nproc, "local ranks (CP degree)")->check(int_range(2, 64));
  cmd->add_option("--strategy", a.strategies, "strategies to run (default both), or auto (the planner's choice)")
      ->delimiter(',');
  cmd->add_option("--ulysses", a.ulysses, "Ulysses degree (0: U = P on one host; on several, the largest U whose Ulysses groups stay inside a host), or auto (the planner's choice)");
  add_plan_hardware_option(cmd, a.plan_hardware);
  cmd->add_option("--seq", a.seq, "global sequence length")->check(int_range(1, 1 << 22));
  cmd->add_option("--batch", a.batch, "batch")->check(int_range(1, 65536));
  cmd->add_option("--hidden", a.hidden, "hidden size");
  cmd->add_option("--heads", a.heads, "heads");
  cmd->add_option("--q-rank", a.q_rank, "q latent rank");
  cmd->add_option("--kv-rank", a.kv_rank, "kv latent rank");
  cmd->add_option("--nope", a.nope, "nope dim");
  cmd->add_option("--rope", a.rope, "rope dim");
  cmd->add_option("--value", a.value, "value dim");
  cmd->add_flag("--gate", a.gate, "output gate");
  cmd->add_option("--dtype", a.dtype, "float32 | bfloat16 (autocast) | float64");
  cmd->add_option("--steps", a.steps, "timed steps per configuration")->check(int_range(1, 1000));
  cmd->add_option("--warmup", a.warmup, "untimed steps first")->check(int_range(0, 100));
  cmd->add_option("--bandwidth-gbps", a.bandwidth_gbps, "emulated link bandwidth, GB/s (0: none)")->check(non_negative());
  cmd->add_option("--latency-us", a.latency_us, "emulated link latency, microseconds")->check(non_negative());
  cmd->add_flag("--auto-link", a.auto_link,
                "size the link per strategy so each overlapped transfer takes at most --transfer-fraction of the "
                "computation under it (measured without a link first)");
  cmd->add_option("--transfer-fraction", a.transfer_fraction, "with --auto-link: transfer time / computation under it");
  cmd->add_flag("--kv-recompute", a.kv_recompute,
                "latent strategy: expand K/V a few heads at a time in the forward and again in the backward instead "
                "of keeping them (less memory, one more kv_b_proj pass, the same values)");
  cmd->add_flag("!--no-pin", a.pin, "do not pin each local rank to its own cores");
  cmd->add_flag("!--no-batch-sched", a.batch_scheduling,
                "keep the default scheduler (bench runs ranks under SCHED_BATCH: backend threads do not preempt the "
                "computation they overlap)");
  cmd->add_option("--json", a.json_path, "also write the results as JSON")->check(output_file());
  cmd->add_option("--trace", a.trace_dir, "write one Chrome/Perfetto trace per rank and configuration here")
      ->check(output_folder());
  add_timeout_option(cmd, a.timeout_s, "collective timeout in seconds (a dead peer is an error after it)");
  add_device_options(cmd, a.device);
  return cmd;
}

// The layer of the run and every check that needs no collective; the launcher runs it before
// starting any rank (world_size = --nproc), each rank again before its first collective.
struct BenchSetup {
  MlaConfig cfg;
  at::ScalarType dtype = at::kFloat;
  std::vector<CpStrategy> strategies;
  MeshShape shape;
  MemoryEstimate memory;  // the run's tensor bytes per rank, estimated before anything is allocated
};

MlaConfig bench_config(const BenchArgs& a) {
  MlaConfig cfg = preset_config("tiny");
  cfg.hidden_size = a.hidden;
  cfg.num_heads = a.heads;
  cfg.q_lora_rank = a.q_rank;
  cfg.kv_lora_rank = a.kv_rank;
  cfg.qk_nope_head_dim = a.nope;
  cfg.qk_rope_head_dim = a.rope;
  cfg.v_head_dim = a.value;
  cfg.output_gate = a.gate;
  cfg.validate();
  return cfg;
}

bool is_auto(const BenchArgs& a) {
  return (a.strategies.size() == 1 && a.strategies[0] == "auto") || a.ulysses == "auto";
}

int64_t ulysses_of(const BenchArgs& a) { return parse_count("bench", "ulysses", a.ulysses); }

// --strategy auto / --ulysses auto: the planner's choice among what the command leaves open
// (bench runs head_tail, overlap off and on).
PlanReport bench_auto_plan(const CommonArgs& common, const BenchArgs& a, int64_t world_size) {
  for (const std::string& s : a.strategies)
    MLACP_REQUIRE(s != "auto" || a.strategies.size() == 1, "bench", "--strategy auto cannot be listed with strategies",
                  {got("strategy", s)}, "pass --strategy auto alone");
  AutoPlanQuery q;
  q.config = bench_config(a);
  q.seq_len = a.seq;
  q.batch = a.batch;
  q.cp = world_size;
  q.dtype = a.dtype;
  if (!(a.strategies.size() == 1 && a.strategies[0] == "auto")) {
    MLACP_REQUIRE(a.strategies.size() <= 1, "bench", "--ulysses auto takes one strategy or auto",
                  {got("strategies", a.strategies.size())}, "pass --strategy latent_kv_head or --strategy auto");
    if (a.strategies.size() == 1) q.strategy = parse_strategy(a.strategies[0]);
  }
  if (a.ulysses != "auto") q.ulysses = ulysses_of(a) == 0 ? world_size : ulysses_of(a);
  q.partition = CpPartition::head_tail;
  q.bandwidth_gbps = a.bandwidth_gbps;
  q.latency_us = a.latency_us;
  q.hardware = a.plan_hardware;
  q.memory_bytes_per_rank = auto_plan_memory_per_rank(common, a.device.cuda(), world_size);
  q.cpu_run = !a.device.cuda();
  return plan_for_auto(q);
}

BenchSetup bench_setup(const CommonArgs& common, const BenchArgs& a, int64_t world_size, int launcher_ranks) {
  BenchSetup b;
  MlaConfig& cfg = b.cfg;
  cfg = bench_config(a);
  b.dtype = parse_dtype(a.dtype);
  for (const auto& s : a.strategies) b.strategies.push_back(parse_strategy(s));
  if (b.strategies.empty()) b.strategies = {CpStrategy::expanded_ulysses, CpStrategy::latent_kv_head};
  b.shape = MeshShape{1, world_size, 1, ulysses_of(a)};
  MLACP_REQUIRE(!a.kv_recompute || std::find(b.strategies.begin(), b.strategies.end(), CpStrategy::latent_kv_head) !=
                                       b.strategies.end(),
                "bench", "--kv-recompute applies to the latent strategy, which this run does not include",
                {got("strategies", a.strategies.size())}, "add --strategy latent_kv_head or drop --kv-recompute");
  for (CpStrategy s : b.strategies) CpPlan(bench_spec(cfg, b.shape, s, a));
  check_shardable(CpPartition::head_tail, a.seq, world_size);
  MLACP_REQUIRE(a.transfer_fraction > 0.0 && a.transfer_fraction <= 4.0, "bench",
                "--transfer-fraction must be in (0, 4]", {got("transfer_fraction", a.transfer_fraction)},
                "0.5 sizes each overlapped transfer to half of the computation under it");
  // Memory: the global inputs, every strategy's module, one strategy's step at a time.
  LayerShape layer;
  layer.batch = a.batch;
  layer.seq_len = a.seq;
  layer.hidden = a.hidden;
  layer.output_gate = a.gate;
  layer.element_bytes = b.dtype == at::kDouble ? 8 : 4;
  layer.attention_bytes = b.dtype == at::kBFloat16 ? 2 : 0;
  const int64_t local_ranks = launcher_ranks > 0 ? launcher_ranks : local_world_size(world_from_env());
  layer.threads = rank_threads(common, local_ranks);
  // One strategy's pair of modules (overlap off and on) lives at a time: the largest step, and the
  // other module of its pair, whose gradients run_step has freed (it sets them to undefined).
  MemoryEstimate estimate, largest;
  double other_module = 0;
  for (CpStrategy s : b.strategies) {
    const CpPlan plan(bench_spec(cfg, b.shape, s, a));
    const MemoryEstimate m = layer_memory(plan, layer);
    if (m.total() > largest.total()) largest = m;
    other_module = std::max(other_module, layer_parameter_elements(plan, layer) * layer.element_bytes);
  }
  estimate.add("the pair's other module", other_module);
  estimate.add(largest);
  // The global input and output weight, this rank's shards of both and the input's gradient.
  const double tokens = static_cast<double>(a.batch) * static_cast<double>(a.seq) * static_cast<double>(a.hidden);
  estimate.add("inputs", (2.0 * tokens + 3.0 * tokens / static_cast<double>(world_size)) * layer.element_bytes);
  check_device_args(a.device, local_ranks, "bench");
  MLACP_REQUIRE(!a.device.cuda() || (a.bandwidth_gbps == 0.0 && a.latency_us == 0.0 && !a.auto_link), "bench",
                "the emulated link is host-timed and serves CPU runs only",
                {got("device", a.device.device), got("bandwidth_gbps", a.bandwidth_gbps), got("latency_us", a.latency_us),
                 got("auto_link", a.auto_link)},
                "drop --bandwidth-gbps/--latency-us/--auto-link with --device cuda: the GPUs' link is real");
  // The memory check covers host memory: on a GPU the tensors are the device's (README "GPU").
  if (!a.device.cuda()) check_run_memory(common, "bench", estimate, launcher_ranks);
  b.memory = estimate;
  return b;
}

int run_bench(const CommonArgs& common, const BenchArgs& a) {
  if (is_auto(a)) {
    // Resolved once, by the launcher (the ranks get the choice on their command line), or on
    // every rank alike under torchrun, where only a profile or file gives every rank one answer.
    MLACP_REQUIRE(!launched_as_rank() || !a.plan_hardware.empty(), "bench",
                  "--strategy/--ulysses auto under torchrun needs --plan-hardware (a calibration per rank could choose "
                  "differently on each)",
                  {}, "write one with mlacp plan --calibrate --save-hardware FILE and pass --plan-hardware FILE");
    const PlanReport report = bench_auto_plan(common, a, launched_as_rank() ? world_from_env().size : a.nproc);
    BenchArgs chosen = a;
    chosen.strategies = {strategy_name(report.choice().spec.strategy)};
    chosen.ulysses = std::to_string(report.choice().spec.ulysses);
    chosen.kv_recompute = a.kv_recompute || report.choice().spec.kv_recompute;  // the planner's, when memory is short
    chosen.plan_hardware.clear();
    if (!launched_as_rank() || world_from_env().rank == 0) std::cout << auto_choice_text(report) << std::flush;
    if (!launched_as_rank()) {
      CommonArgs with = common;
      with.argv = with_planned_choice(common.argv, {{"--strategy", chosen.strategies[0]}, {"--ulysses", chosen.ulysses}});
      if (chosen.kv_recompute) with.argv = with_planned_flag(with.argv, "--kv-recompute");
      return run_bench(with, chosen);
    }
    return run_bench(common, chosen);
  }
  if (!launched_as_rank()) {
    bench_setup(common, a, a.nproc, a.nproc);  // every rule before any rank starts
    // Each local rank on its own cores unless asked otherwise: on a small host an unpinned rank
    // migrates and the two ranks' speeds drift apart, which shows up as waiting.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int threads = common.threads > 0 ? common.threads : std::max(1, cores / a.nproc);
    CommonArgs ranks = common;
    if (a.pin && !common.pin_cores && a.nproc * threads <= cores) ranks.argv.insert(ranks.argv.begin() + 1, "--pin-cores");
    if (a.batch_scheduling && !common.batch_scheduling) ranks.argv.insert(ranks.argv.begin() + 1, "--batch-sched");
    return relaunch_local(ranks, a.nproc);
  }
  apply_threads(common);
  const WorldInfo world = world_from_env();
  const bool lead = world.rank == 0;
  const BenchSetup setup = bench_setup(common, a, world.size, 0);  // every check before the first collective
  const MlaConfig& cfg = setup.cfg;
  const at::ScalarType dtype = setup.dtype;
  const bool bf16 = dtype == at::kBFloat16;
  const at::ScalarType param_dtype = bf16 ? at::kFloat : dtype;
  const std::vector<CpStrategy>& strategies = setup.strategies;
  const MeshShape shape = setup.shape;
  if (!a.trace_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.trace_dir, ec);
    MLACP_REQUIRE(!ec && std::filesystem::is_directory(a.trace_dir), "bench", "--trace must name a directory that can be created",
                  {got("trace", a.trace_dir), got("error", ec ? ec.message() : std::string("not a directory"))},
                  "pass a writable path, e.g. --trace /tmp/mlacp-trace");
  }

  const c10::Device device = rank_device(a.device, world);
  GroupOptions options = group_options_for(a.device, device, a.timeout_s);
  options.link.latency_seconds = a.latency_us * 1e-6;
  options.link.bandwidth_bytes_per_second = a.bandwidth_gbps * 1e9;
  Rendezvous rendezvous = Rendezvous::of(world, options.timeout);
  ParallelGroups groups = rendezvous.groups(shape, options);
  if (lead && groups.topology.hosts() > 1) std::cerr << "bench: " << groups.describe() << "\n";
  const LinkModel fixed_link = *groups.instruments.link;

  // The run's tensor bytes from here on (the inputs, the modules, the steps), against the estimate:
  // the highest live bytes any step reached, and the peak counter after the last one.
  const MemoryScope run_memory;
  double run_peak_bytes = 0;
  VerifyCase vc{"bench", cfg};
  vc.batch = a.batch;
  vc.seq_len = a.seq;
  CaseInputs global = inputs_on(make_case_inputs(vc, param_dtype), device);
  at::Tensor hidden = shard_sequence(global.hidden, CpPartition::head_tail, world.size, groups.cp_rank)
                          .detach().clone().requires_grad_(true);
  at::Tensor weight = shard_sequence(global.output_weight, CpPartition::head_tail, world.size, groups.cp_rank)
                          .to(at::kFloat);

  // Overlap off and on run in alternating steps, so a change in the machine's load affects both
  // alike (these shared machines are noisy). Returns the timed steps of each mode.
  auto run_pair = [&](CpStrategy strategy, int steps, const std::string& what) {
    MlaAttention modules[2] = {make_case_module(vc, param_dtype), make_case_module(vc, param_dtype)};
    for (int overlap = 0; overlap < 2; ++overlap) {
      modules[overlap]->to(device);
      parallelize(modules[overlap], groups,
                  {strategy, CpPartition::head_tail, overlap == 1, AttentionKernel::blockwise,
                   a.kv_recompute && strategy == CpStrategy::latent_kv_head});
    }
    std::array<std::vector<StepSample>, 2> samples;
    for (int i = 0; i < a.warmup + steps; ++i) {
      for (int overlap = 0; overlap < 2; ++overlap) {
        RankStep st = run_step(modules[overlap], hidden, weight, global.options, groups, bf16);
        run_peak_bytes = std::max(run_peak_bytes, st.peak_live_bytes - static_cast<double>(run_memory.baseline_bytes()));
        if (!a.trace_dir.empty() && what == "timed" && i + 1 == a.warmup + steps) {
          std::ofstream(a.trace_dir + "/" + strategy_name(strategy) + (overlap ? "-overlap" : "-plain") + "-rank" +
                        std::to_string(world.rank) + ".json")
              << groups.instruments.timeline->chrome_trace_json(world.rank);
        }
        StepSample combined = combine(st, groups.world);
        if (i >= a.warmup) samples[overlap].push_back(std::move(combined));
      }
      if (lead) std::cerr << "\rbench: " << strategy_name(strategy) << " " << what << " step " << i + 1 << "/"
                          << a.warmup + steps << std::flush;
    }
    if (lead) std::cerr << "\n";
    return samples;
  };

  Table table({"strategy", "overlap", "link GB/s", "step ms", "a2a KB", "gather KB", "rs KB", "formula KB", "comm ms",
               "exposed ms", "exposed %", "blocked ms", "peak MiB"});
  Table criteria({"strategy", "overlapped transfers", "transfer/compute", "their comm ms", "exposed on ms", "hidden %",
                  "exposed off ms", "step saved ms", "saved %", "paired saved ms", "met"});
  json rows = json::array();
  bool all_met = true;
  for (CpStrategy s : strategies) {
    const CpPlan plan(bench_spec(cfg, groups.shape, s, a));  // U as the hosts set it
    const std::string label = strategy_name(s) + (plan.kv_recompute() ? " kv_recompute" : "");
    const std::set<std::string> labels = overlapped_labels(plan, cfg, device.type());
    *groups.instruments.link = fixed_link;
    if (a.auto_link) {
      // Calibration without a link: the computation the schedule places under each overlapped
      // transfer (launch to wait, on the rank where it is shortest, median over steps).
      *groups.instruments.link = LinkModel{};
      const auto calib = run_pair(s, std::max(3, a.steps / 2), "calibration")[1];
      const LabelTimes under = median_by_label(calib, &StepSample::compute_under_us);
      groups.instruments.link->bandwidth_bytes_per_second = bandwidth_for_fraction(labels, under, calib.front().bytes,
                                                                       a.transfer_fraction);
      groups.instruments.link->latency_seconds = 0;
      MLACP_REQUIRE(groups.instruments.link->bandwidth_bytes_per_second > 0, "bench", "calibration found no overlapped transfer",
                    {got("strategy", strategy_name(s))}, "use --bandwidth-gbps");
    }
    const LinkModel link = *groups.instruments.link;
    const auto pair = run_pair(s, a.steps, "timed");
    const std::vector<StepSample>& off = pair[0];
    const std::vector<StepSample>& on = pair[1];

    const CommVolume v = expected_comm_elements(plan, a.batch, a.seq);
    const int64_t es = bf16 ? 2 : c10::elementSize(param_dtype);
    const double formula_kb =
        (v.forward_all_to_all + v.forward_output + v.forward_all_gather + v.backward_all_to_all) * es / 1024.0 +
        v.backward_reduce * (bf16 ? 4 : es) / 1024.0;
    LinkTime link_us;
    if (link.enabled()) link_us = [link](int64_t bytes) { return 1e6 * link.transfer_seconds(bytes); };
    for (int overlap = 0; overlap < 2; ++overlap) {
      const auto& steps = pair[overlap];
      const auto& bytes = steps.front().bytes;
      const LabelTimes exposed = median_by_label(steps, &StepSample::exposed_us);
      const LabelTimes blocked = median_by_label(steps, &StepSample::blocked_us);
      double comm_us = 0;
      for (const auto& [label, b] : bytes) comm_us += transfer_duration_us(label, overlap == 1, link_us, off, on);
      const double step_ms = median_step_us(steps) / 1000.0, exposed_ms = sum(exposed) / 1000.0;
      const double comm_ms = comm_us / 1000.0;
      std::vector<double> peaks;
      for (const StepSample& st : steps) peaks.push_back(st.peak_bytes);
      const double peak_bytes = median(peaks);
      const double fraction = comm_ms > 0 ? exposed_ms / comm_ms : 0.0;
      table.add({label, overlap ? "on" : "off",
                 link.bandwidth_bytes_per_second > 0 ? fixed(link.bandwidth_bytes_per_second / 1e9, 3) : "none",
                 fixed(step_ms, 2), fixed(bytes_of_kind(steps, CollectiveKind::all_to_all) / 1024.0, 1),
                 fixed(bytes_of_kind(steps, CollectiveKind::all_gather) / 1024.0, 1),
                 fixed(bytes_of_kind(steps, CollectiveKind::reduce_scatter) / 1024.0, 1), fixed(formula_kb, 1),
                 fixed(comm_ms, 2), fixed(exposed_ms, 2), fixed(100.0 * fraction, 1), fixed(sum(blocked) / 1000.0, 2),
                 device.is_cpu() ? fixed(peak_bytes / (1024.0 * 1024.0), 1) : "-"});
      rows.push_back({{"strategy", strategy_name(s)}, {"kv_recompute", plan.kv_recompute()}, {"overlap", overlap == 1},
                      {"link_bandwidth_bytes_per_s", link.bandwidth_bytes_per_second},
                      {"link_latency_s", link.latency_seconds}, {"median_step_ms", step_ms},
                      {"bytes_all_to_all", bytes_of_kind(steps, CollectiveKind::all_to_all)},
                      {"bytes_all_gather", bytes_of_kind(steps, CollectiveKind::all_gather)},
                      {"bytes_reduce_scatter", bytes_of_kind(steps, CollectiveKind::reduce_scatter)},
                      {"formula_bytes", formula_kb * 1024.0}, {"comm_ms", comm_ms}, {"exposed_ms", exposed_ms},
                      {"exposed_fraction", fraction}, {"blocked_ms", sum(blocked) / 1000.0},
                      {"peak_step_bytes", device.is_cpu() ? json(peak_bytes) : json(nullptr)},
                      {"exposed_ms_by_label", per_label_ms(exposed)}, {"blocked_ms_by_label", per_label_ms(blocked)},
                      {"compute_under_ms_by_label", per_label_ms(median_by_label(steps, &StepSample::compute_under_us))},
                      {"compute_ms_by_span", per_label_ms(median_by_label(steps, &StepSample::compute_us))},
                      {"bytes_by_label", bytes}});
    }
    // The transfers the schedule places under computation.
    const OverlapSummary o = summarize_overlap(off, on, labels, link_us);
    const bool met = o.met();
    all_met = all_met && met;
    criteria.add({label, joined(labels), fixed(o.max_transfer_to_compute, 2), fixed(o.comm_us / 1000.0, 2),
                  fixed(o.exposed_on_us / 1000.0, 2), fixed(o.hidden_percent(), 1), fixed(o.exposed_off_us / 1000.0, 2),
                  fixed(o.saved_us / 1000.0, 2), fixed(o.saved_percent(), 1), fixed(o.paired_saved_us / 1000.0, 2),
                  met ? "yes" : "no"});
    rows.push_back({{"strategy", strategy_name(s)}, {"overlapped_labels", joined(labels)},
                    {"link_bandwidth_bytes_per_s", link.bandwidth_bytes_per_second},
                    {"max_transfer_to_compute_ratio", o.max_transfer_to_compute},
                    {"overlapped_comm_ms", o.comm_us / 1000.0}, {"overlapped_exposed_ms", o.exposed_on_us / 1000.0},
                    {"queued_behind_overlapped_ms", o.queued_us / 1000.0},
                    {"overlapped_hidden_percent", o.hidden_percent()},
                    {"overlapped_exposed_off_ms", o.exposed_off_us / 1000.0}, {"step_saved_ms", o.saved_us / 1000.0},
                    {"step_saved_percent_of_exposed_off", o.saved_percent()},
                    {"paired_step_saved_ms", o.paired_saved_us / 1000.0},
                    {"criteria_met", met}});
  }
  run_peak_bytes = std::max(run_peak_bytes, static_cast<double>(run_memory.peak_extra_bytes()));
  run_peak_bytes = all_reduce_max(groups.world, {run_peak_bytes})[0];  // the rank that allocated most
  const double estimate_bytes = setup.memory.total();
  if (lead) {
    std::cout << "bench: " << world.size << " ranks, S=" << a.seq << " B=" << a.batch << " heads=" << a.heads
              << " hidden=" << a.hidden << " q_rank=" << a.q_rank << " kv_rank=" << a.kv_rank
              << " dtype=" << a.dtype << ", median of " << a.steps << " steps after " << a.warmup
              << " warm-up; threads/rank " << at::get_num_threads() << (common.pin_cores ? ", pinned" : "")
              << (common.batch_scheduling ? ", SCHED_BATCH" : "") << "\n"
              << "exposed: time the last rank to arrive is blocked in waits (critical path); blocked: the rank "
                 "that waited longest (includes waiting for a late peer); peak: the tensor bytes one step allocated "
                 "at its highest on the rank that allocated most (LibTorch's CPU allocator, counted; median over "
                 "steps)\n\n";
    table.print(std::cout);
    std::cout << "\nTransfers the overlap schedule places under computation (met: hidden >= 90% and saved >= 80% "
                 "of their exposed time with overlap off):\n";
    criteria.print(std::cout);
    if (device.is_cpu())
      std::cout << "\nmemory: the run's tensors peaked at " << format_bytes(run_peak_bytes)
                << " on the rank that allocated most; estimated before the run: " << format_bytes(estimate_bytes) << " ("
                << fixed(estimate_bytes / std::max(1.0, run_peak_bytes), 2) << "x; " << setup.memory.to_text() << ")\n";
    if (!a.json_path.empty()) {
      const json doc{{"world_size", world.size}, {"seq", a.seq}, {"batch", a.batch}, {"steps", a.steps},
                     {"warmup", a.warmup}, {"pinned", common.pin_cores}, {"sched_batch", common.batch_scheduling},
                     {"all_criteria_met", all_met}, {"run_peak_bytes", device.is_cpu() ? json(run_peak_bytes) : json(nullptr)},
                     {"memory_estimate_bytes", estimate_bytes}, {"rows", rows}};
      write_output_file("--json", a.json_path, doc.dump(2) + "\n");
    }
  }
  return 0;
}

}  // namespace mlacp::tools
