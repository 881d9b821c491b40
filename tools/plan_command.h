// `mlacp plan` and what the other commands take from it: the model options, and `--strategy
// auto` / `--ulysses auto` resolved by the planner (include/mlacp/planner.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "mlacp/config.h"
#include "mlacp/planner.h"

namespace mlacp::tools {

// The layer: a preset or a config.json, with single fields overridden.
struct ModelArgs {
  std::string preset = "deepseek-v3";
  std::string config_path;
  std::optional<int64_t> hidden, heads, q_rank, kv_rank, nope, rope, value;
  bool gate = false;
};
void add_model_options(CLI::App* cmd, ModelArgs& args);
MlaConfig model_config(const ModelArgs& args);  // validated

struct PlanArgs {
  ModelArgs model;
  int64_t seq = 0, batch = 1;
  std::string dtype = "bfloat16";
  int64_t devices = 0, cp = 0, tp = 1, ulysses = 0;
  std::vector<std::string> strategies, partitions;
  std::string overlap = "both";
  bool causal = true;
  std::string hardware = "h200-nvlink-ib";
  bool calibrate = false;
  bool calibrate_link = false;  // under torchrun on several hosts: the links between them
  int64_t calibrate_seq = 1024;
  int timeout_s = 120;
  std::string save_hardware;
  bool show_hardware = false;
  std::optional<double> bandwidth_gbps, latency_us, inter_bandwidth_gbps;
  double emulated_gbps = 0, emulated_latency_us = 0;  // bench's emulated link, on top of the hardware's
  size_t rows = 24;
  std::string json_path;
};
CLI::App* add_plan_command(CLI::App& app, PlanArgs& args);
int run_plan(const CommonArgs& common, const PlanArgs& args);

// `--strategy auto` and `--ulysses auto` of verify, bench and train: the planner's choice for the
// run's layer, S, batch, dtype, CP and TP degrees and link, among the candidates the command
// leaves open (fixed fields stay fixed). Hardware: `--plan-hardware` (a profile or a file) or,
// by default, a calibration of this machine. The returned report's choice is what runs.
struct AutoPlanQuery {
  MlaConfig config;
  int64_t seq_len = 0, batch = 1, cp = 1, tp = 1;
  std::string dtype = "float32";
  std::optional<CpStrategy> strategy;      // fixed, or chosen
  std::optional<int64_t> ulysses;          // fixed, or chosen
  std::optional<CpPartition> partition;    // fixed, or chosen
  std::optional<bool> overlap;             // fixed, or chosen
  double bandwidth_gbps = 0, latency_us = 0;  // the link the run will have (0: none)
  std::string hardware;                    // "" : calibrate this machine
  bool causal = true;
  // The memory a rank may use (the run's memory limit over the host's ranks), in place of the
  // hardware's; 0: the hardware's. Where a latent candidate's layer does not fit, the planner
  // tries it with K/V recompute (PlanRequest::kv_recompute_when_short).
  double memory_bytes_per_rank = 0;
  bool cpu_run = true;  // the run's tensors on the CPU: K/V recompute is possible (the CPU kernel's)
};
PlanReport plan_for_auto(const AutoPlanQuery& query);
// --plan-hardware of verify, bench and train: a profile name or a hardware file (checked while
// parsing), for AutoPlanQuery::hardware.
void add_plan_hardware_option(CLI::App* cmd, std::string& hardware);
// "auto: <choice> (planner: ...)" lines for the command's output.
std::string auto_choice_text(const PlanReport& report);
// The command line with each flag's value replaced by the given one (`--flag V` and `--flag=V`),
// the flag appended where absent: what the ranks run once auto is resolved.
std::vector<std::string> with_planned_choice(std::vector<std::string> argv,
                                             const std::vector<std::pair<std::string, std::string>>& values);
// The command line with a flag the choice turns on (e.g. --kv-recompute), appended where absent.
std::vector<std::string> with_planned_flag(std::vector<std::string> argv, const std::string& flag);
// A whole number >= 0 from an option's text (a count such as --ulysses); an mlacp::Error naming
// the option otherwise.
int64_t parse_count(const std::string& what, const std::string& option, const std::string& text);

}  // namespace mlacp::tools
