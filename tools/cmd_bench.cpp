// `mlacp bench`: step time and communication of each strategy with overlap off and on, on local
// ranks over an optional emulated link (SPEC §10). For each configuration: the median step
// (forward + backward) over --steps after --warmup, bytes per rank per collective kind next to
// the SPEC §4 formula, communication time, exposed communication (time blocked in waits) and the
// hidden fraction. With overlap on it also reports how much of the transfers the schedule places
// under computation was hidden, and how much step time overlap saved against what those
// transfers cost when exposed (overlap off).
//   --auto-link sizes the link bandwidth so that each overlapped transfer takes about half of
//   the computation placed under it (measured in a calibration run without a link).
#include <algorithm>
#include <array>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "check/cases.h"
#include "commands.h"
#include "core/compat.h"
#include "core/format.h"
#include "core/timeline.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "table.h"

namespace mlacp::tools {
namespace {

using nlohmann::json;

struct StepStats {
  double step_ms = 0;
  std::map<std::string, double> wait_us, transfer_us, gap_us;  // per label
  std::map<std::string, int64_t> bytes_by_label;
  std::map<CollectiveKind, int64_t> bytes_by_kind;
};

// Collectives whose launch the schedule places before computation (SPEC §5), by label.
std::set<std::string> overlapped_labels(CpStrategy strategy, bool gate, int64_t all_gather) {
  if (strategy == CpStrategy::latent_kv_head) return {"latent", "q", "dO", "dq", "dlatent"};
  if (all_gather > 1) return {"kv"};
  std::set<std::string> labels{"v", "k", "dO", "dk", "dv"};
  if (gate) labels.insert({"q", "dq"});
  return labels;
}

// What the same transfers are called with overlap off, and the share of a packed one they make.
double exposed_off_for(const StepStats& off, const StepStats& on, const std::set<std::string>& labels) {
  double total = 0;
  auto share = [&](const std::string& packed, const std::vector<std::string>& parts) {
    int64_t part_bytes = 0, all_bytes = 0;
    for (const auto& [label, bytes] : on.bytes_by_label) {
      const bool in_packed = std::find(parts.begin(), parts.end(), label) != parts.end();
      if (in_packed && labels.count(label)) part_bytes += bytes;
    }
    for (const auto& p : parts) all_bytes += on.bytes_by_label.count(p) ? on.bytes_by_label.at(p) : 0;
    const double wait = off.wait_us.count(packed) ? off.wait_us.at(packed) : 0.0;
    return all_bytes > 0 ? wait * static_cast<double>(part_bytes) / static_cast<double>(all_bytes) : 0.0;
  };
  total += share("qkv", {"q", "k", "v"});
  total += share("dqkv", {"dq", "dk", "dv"});
  for (const std::string& label : {"latent", "q", "dlatent", "kv"})
    if (labels.count(label) && off.wait_us.count(label) && !on.bytes_by_label.count("v")) total += off.wait_us.at(label);
  if (labels.count("dq") && off.wait_us.count("dq") && !on.bytes_by_label.count("v")) total += off.wait_us.at("dq");
  if (labels.count("dO") && off.wait_us.count("do")) total += off.wait_us.at("do");
  return total;
}

StepStats one_step(MlaAttention& module, const at::Tensor& hidden, const at::Tensor& weight,
                   const MlaForwardOptions& options, ParallelGroups& groups, bool bf16) {
  groups.counters->reset();
  groups.timeline->clear();
  groups.timeline->set_enabled(true);
  barrier(groups.world);
  const double start = Timeline::now_us();
  {
    std::unique_ptr<compat::AutocastGuard> autocast;
    if (bf16) autocast = std::make_unique<compat::AutocastGuard>(c10::DeviceType::CPU, true, at::kBFloat16);
    at::Tensor y = module->forward(hidden, options);
    (y.to(at::kFloat) * weight).sum().backward();
  }
  StepStats s;
  s.step_ms = (Timeline::now_us() - start) / 1000.0;
  groups.timeline->set_enabled(false);
  std::map<std::string, double> launched;
  for (const auto& e : groups.timeline->events()) {
    if (e.kind == EventKind::launch) launched[e.name] = e.begin_us;
    if (e.kind == EventKind::wait) {
      s.wait_us[e.name] += e.end_us - e.begin_us;
      if (launched.count(e.name)) s.gap_us[e.name] += e.begin_us - launched[e.name];
    }
    if (e.kind == EventKind::transfer) s.transfer_us[e.name] += e.end_us - e.begin_us;
  }
  for (const auto& [label, totals] : groups.counters->by_label()) s.bytes_by_label[label] = totals.bytes;
  for (auto kind : {CollectiveKind::all_to_all, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                    CollectiveKind::all_reduce})
    s.bytes_by_kind[kind] = groups.counters->by_kind(kind).bytes;
  for (auto& item : module->parameters()) item.mutable_grad() = at::Tensor();
  return s;
}

double sum(const std::map<std::string, double>& m, const std::set<std::string>* only = nullptr) {
  double total = 0;
  for (const auto& [k, v] : m)
    if (!only || only->count(k)) total += v;
  return total;
}

json per_label_ms(const std::map<std::string, double>& us) {
  json out = json::object();
  for (const auto& [label, value] : us) out[label] = value / 1000.0;
  return out;
}

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchArgs& a) {
  CLI::App* cmd = app.add_subcommand("bench", "step time and exposed communication per strategy, overlap off/on");
  cmd->add_option("--nproc", a.nproc, "local ranks (CP degree)")->check(CLI::Range(2, 64));
  cmd->add_option("--strategy", a.strategies, "strategies to run (default both)")->delimiter(',');
  cmd->add_option("--ulysses", a.ulysses, "Ulysses degree (0: U = P)");
  cmd->add_option("--seq", a.seq, "global sequence length");
  cmd->add_option("--batch", a.batch, "batch");
  cmd->add_option("--hidden", a.hidden, "hidden size");
  cmd->add_option("--heads", a.heads, "heads");
  cmd->add_option("--q-rank", a.q_rank, "q latent rank");
  cmd->add_option("--kv-rank", a.kv_rank, "kv latent rank");
  cmd->add_option("--nope", a.nope, "nope dim");
  cmd->add_option("--rope", a.rope, "rope dim");
  cmd->add_option("--value", a.value, "value dim");
  cmd->add_flag("--gate", a.gate, "output gate");
  cmd->add_option("--dtype", a.dtype, "float32 | bfloat16 (autocast) | float64");
  cmd->add_option("--steps", a.steps, "timed steps per configuration")->check(CLI::Range(1, 1000));
  cmd->add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::Range(0, 100));
  cmd->add_option("--bandwidth-gbps", a.bandwidth_gbps, "emulated link bandwidth, GB/s (0: none)");
  cmd->add_option("--latency-us", a.latency_us, "emulated link latency, microseconds");
  cmd->add_flag("--auto-link", a.auto_link, "size the link so overlapped transfers take ~half their compute");
  cmd->add_option("--json", a.json_path, "also write the results as JSON");
  cmd->add_option("--trace", a.trace_dir, "write one Chrome/Perfetto trace per rank and configuration here");
  cmd->add_option("--timeout", a.timeout_s, "collective timeout, seconds");
  return cmd;
}

int run_bench(const CommonArgs& common, const BenchArgs& a) {
  if (!launched_as_rank()) return relaunch_local(common, a.nproc);
  apply_threads(common);
  const WorldInfo world = world_from_env();
  const bool lead = world.rank == 0;
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
  const at::ScalarType dtype = parse_dtype(a.dtype);
  const bool bf16 = dtype == at::kBFloat16;
  const at::ScalarType param_dtype = bf16 ? at::kFloat : dtype;
  std::vector<CpStrategy> strategies;
  for (const auto& s : a.strategies) strategies.push_back(parse_strategy(s));
  if (strategies.empty()) strategies = {CpStrategy::expanded_ulysses, CpStrategy::latent_kv_head};
  const MeshShape shape{1, world.size, 1, a.ulysses};
  // Every check before the first collective.
  for (CpStrategy s : strategies) CpPlan(plan_spec_for(cfg, shape, s, CpPartition::head_tail, true));
  check_shardable(CpPartition::head_tail, a.seq, world.size);

  GroupOptions options;
  options.timeout = std::chrono::seconds(a.timeout_s);
  options.link.latency_seconds = a.latency_us * 1e-6;
  options.link.bandwidth_bytes_per_second = a.bandwidth_gbps * 1e9;
  Rendezvous rendezvous = Rendezvous::tcp(world, options.timeout);
  ParallelGroups groups = rendezvous.groups(shape, options);

  VerifyCase vc{"bench", cfg};
  vc.batch = a.batch;
  vc.seq_len = a.seq;
  CaseInputs global = make_case_inputs(vc, param_dtype);
  at::Tensor hidden = shard_sequence(global.hidden, CpPartition::head_tail, world.size, groups.cp_rank)
                          .detach().clone().requires_grad_(true);
  at::Tensor weight = shard_sequence(global.output_weight, CpPartition::head_tail, world.size, groups.cp_rank)
                          .to(at::kFloat);

  // Overlap off and on run in alternating steps, so a change in the machine's load affects both
  // alike (these shared machines are noisy); the median step of each stands for it.
  auto run_pair = [&](CpStrategy strategy) {
    MlaAttention modules[2] = {make_case_module(vc, param_dtype), make_case_module(vc, param_dtype)};
    for (int overlap = 0; overlap < 2; ++overlap) {
      install_context_parallel(
          modules[overlap], CpPlan(plan_spec_for(cfg, shape, strategy, CpPartition::head_tail, overlap == 1)), groups);
    }
    std::vector<StepStats> steps[2];
    for (int i = 0; i < a.warmup + a.steps; ++i) {
      for (int overlap = 0; overlap < 2; ++overlap) {
        StepStats st = one_step(modules[overlap], hidden, weight, global.options, groups, bf16);
        if (i >= a.warmup) steps[overlap].push_back(st);
        if (!a.trace_dir.empty() && i + 1 == a.warmup + a.steps) {
          std::ofstream(a.trace_dir + "/" + strategy_name(strategy) + (overlap ? "-overlap" : "-plain") + "-rank" +
                        std::to_string(world.rank) + ".json")
              << groups.timeline->chrome_trace_json(world.rank);
        }
      }
      if (lead) std::cerr << "\rbench: " << strategy_name(strategy) << " step " << i + 1 << "/" << a.warmup + a.steps
                          << std::flush;
    }
    if (lead) std::cerr << "\n";
    std::array<StepStats, 2> medians;
    for (int overlap = 0; overlap < 2; ++overlap) {
      auto& v = steps[overlap];
      std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.step_ms < y.step_ms; });
      medians[overlap] = v[v.size() / 2];
    }
    return medians;
  };

  if (a.auto_link) {
    // Calibration without a link: the compute the schedule places under each overlapped transfer.
    groups.link->bandwidth_bytes_per_second = 0;
    groups.link->latency_seconds = 0;
    double needed = 0;
    for (CpStrategy s : strategies) {
      const StepStats calib = run_pair(s)[1];
      const auto labels = overlapped_labels(s, cfg.output_gate, world.size / (a.ulysses ? a.ulysses : world.size));
      for (const auto& label : labels) {
        if (!calib.gap_us.count(label) || !calib.bytes_by_label.count(label)) continue;
        const double half_gap_s = 0.5 * calib.gap_us.at(label) * 1e-6;
        if (half_gap_s <= 0) continue;
        const double bandwidth = calib.bytes_by_label.at(label) / half_gap_s;
        if (lead) {
          std::cerr << "bench: calibration " << strategy_name(s) << " " << label << ": "
                    << calib.bytes_by_label.at(label) << " B under " << fixed(calib.gap_us.at(label) / 1000.0, 2)
                    << " ms of compute -> " << fixed(bandwidth / 1e9, 3) << " GB/s for half of it\n";
        }
        needed = std::max(needed, bandwidth);
      }
    }
    needed = all_reduce_max(groups.world, {needed})[0];
    groups.link->bandwidth_bytes_per_second = needed;
    groups.link->latency_seconds = 0;
    if (lead) std::cerr << "bench: auto link bandwidth " << fixed(needed / 1e9, 3) << " GB/s\n";
  }

  Table table({"strategy", "overlap", "step ms", "a2a KB", "gather KB", "rs KB", "formula KB", "comm ms", "exposed ms",
               "hidden %"});
  json rows = json::array();
  Table criteria({"strategy", "overlapped transfers", "their comm ms", "their exposed ms", "hidden %",
                  "exposed off ms", "step saved ms", "saved / exposed-off %"});
  for (CpStrategy s : strategies) {
    const CpPlan plan(plan_spec_for(cfg, shape, s, CpPartition::head_tail, true));
    const CommVolume v = expected_comm_elements(plan, a.batch, a.seq);
    const int64_t es = bf16 ? 2 : c10::elementSize(param_dtype);
    const double formula_kb =
        (v.forward_all_to_all + v.forward_output + v.forward_all_gather + v.backward_all_to_all) * es / 1024.0 +
        v.backward_reduce * (bf16 ? 4 : es) / 1024.0;
    StepStats by_mode[2];
    const std::array<StepStats, 2> pair = run_pair(s);
    for (bool overlap : {false, true}) {
      StepStats m = pair[overlap];
      // Worst rank decides: a step is as slow as its slowest rank.
      std::vector<double> worst = all_reduce_max(groups.world, {m.step_ms, sum(m.transfer_us), sum(m.wait_us)});
      const double comm_ms = worst[1] / 1000.0, exposed_ms = worst[2] / 1000.0;
      const double hidden = comm_ms > 0 ? 100.0 * (1.0 - exposed_ms / comm_ms) : 100.0;
      by_mode[overlap] = m;
      by_mode[overlap].step_ms = worst[0];
      table.add({strategy_name(s), overlap ? "on" : "off", fixed(worst[0], 2),
                 fixed(m.bytes_by_kind[CollectiveKind::all_to_all] / 1024.0, 1),
                 fixed(m.bytes_by_kind[CollectiveKind::all_gather] / 1024.0, 1),
                 fixed(m.bytes_by_kind[CollectiveKind::reduce_scatter] / 1024.0, 1), fixed(formula_kb, 1),
                 fixed(comm_ms, 2), fixed(exposed_ms, 2), fixed(hidden, 1)});
      rows.push_back({{"strategy", strategy_name(s)}, {"overlap", overlap}, {"median_step_ms", worst[0]},
                      {"bytes_all_to_all", m.bytes_by_kind[CollectiveKind::all_to_all]},
                      {"bytes_all_gather", m.bytes_by_kind[CollectiveKind::all_gather]},
                      {"bytes_reduce_scatter", m.bytes_by_kind[CollectiveKind::reduce_scatter]},
                      {"formula_bytes", formula_kb * 1024.0}, {"comm_ms", comm_ms}, {"exposed_ms", exposed_ms},
                      {"exposed_fraction", comm_ms > 0 ? exposed_ms / comm_ms : 0.0},
                      {"rank0_wait_ms_by_label", per_label_ms(m.wait_us)},
                      {"rank0_transfer_ms_by_label", per_label_ms(m.transfer_us)},
                      {"rank0_launch_to_wait_ms_by_label", per_label_ms(m.gap_us)},
                      {"rank0_bytes_by_label", m.bytes_by_label}});
    }
    const auto labels = overlapped_labels(s, cfg.output_gate, plan.all_gather());
    // A transfer's duration: the link's time for its bytes (with no link: its measured time).
    double modelled_us = 0;
    for (const auto& label : labels) {
      if (!by_mode[1].bytes_by_label.count(label)) continue;
      modelled_us += groups.link->enabled() ? 1e6 * groups.link->transfer_seconds(by_mode[1].bytes_by_label.at(label))
                                            : by_mode[1].transfer_us[label];
    }
    std::vector<double> w = all_reduce_max(
        groups.world, {modelled_us, sum(by_mode[1].wait_us, &labels),
                       exposed_off_for(by_mode[0], by_mode[1], labels)});
    const double their_comm = w[0] / 1000.0, their_exposed = w[1] / 1000.0, exposed_off = w[2] / 1000.0;
    const double saved = by_mode[0].step_ms - by_mode[1].step_ms;
    std::string names;
    for (const auto& l : labels) names += (names.empty() ? "" : ",") + l;
    criteria.add({strategy_name(s), names, fixed(their_comm, 2), fixed(their_exposed, 2),
                  fixed(their_comm > 0 ? 100.0 * (1.0 - their_exposed / their_comm) : 100.0, 1), fixed(exposed_off, 2),
                  fixed(saved, 2), fixed(exposed_off > 0 ? 100.0 * saved / exposed_off : 0.0, 1)});
    rows.push_back({{"strategy", strategy_name(s)}, {"overlapped_labels", names}, {"overlapped_comm_ms", their_comm},
                    {"overlapped_exposed_ms", their_exposed}, {"overlapped_exposed_off_ms", exposed_off},
                    {"step_saved_ms", saved}});
  }
  if (lead) {
    std::cout << "bench: " << world.size << " ranks, S=" << a.seq << " B=" << a.batch << " heads=" << a.heads
              << " hidden=" << a.hidden << " dtype=" << a.dtype << ", median of " << a.steps << " steps after "
              << a.warmup << " warm-up; link bandwidth "
              << (groups.link->bandwidth_bytes_per_second > 0 ? fixed(groups.link->bandwidth_bytes_per_second / 1e9, 3) + " GB/s"
                                                             : std::string("none"))
              << ", latency " << fixed(groups.link->latency_seconds * 1e6, 0) << " us; threads/rank "
              << at::get_num_threads() << "\n\n";
    table.print(std::cout);
    std::cout << "\nTransfers the overlap schedule places under computation:\n";
    criteria.print(std::cout);
    if (!a.json_path.empty()) {
      std::ofstream(a.json_path) << json{{"world_size", world.size}, {"seq", a.seq}, {"batch", a.batch},
                                         {"link_bandwidth_bytes_per_s", groups.link->bandwidth_bytes_per_second},
                                         {"link_latency_s", groups.link->latency_seconds}, {"rows", rows}}
                                        .dump(2)
                                 << "\n";
    }
  }
  return 0;
}

}  // namespace mlacp::tools
