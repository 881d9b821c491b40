// The model options of `mlacp plan`, and `--strategy auto` / `--ulysses auto` for the other
// commands (plan_command.h).
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "mlacp/errors.h"
#include "plan_command.h"
#include "option_checks.h"

namespace mlacp::tools {

void add_model_options(CLI::App* cmd, ModelArgs& a) {
  cmd->add_option("--preset", a.preset, "model preset: deepseek-v3 (default), deepseek-v2-lite, tiny");
  cmd->add_option("--config", a.config_path, "HuggingFace config.json of the model (instead of --preset)")
      ->check(input_file());
  cmd->add_option("--hidden", a.hidden, "hidden size (overrides the preset or config)");
  cmd->add_option("--heads", a.heads, "heads");
  cmd->add_option("--q-rank", a.q_rank, "q latent rank");
  cmd->add_option("--kv-rank", a.kv_rank, "kv latent rank");
  cmd->add_option("--nope", a.nope, "nope dim");
  cmd->add_option("--rope", a.rope, "rope dim");
  cmd->add_option("--value", a.value, "value dim");
  cmd->add_flag("--gate", a.gate, "output gate");
}

void add_plan_hardware_option(CLI::App* cmd, std::string& hardware) {
  cmd->add_option("--plan-hardware", hardware,
                  "with auto: the planner's hardware, a profile or file (default: calibrate this machine)")
      ->check(profile_or_input_file(hardware_profile_names()));
}

MlaConfig model_config(const ModelArgs& a) {
  MlaConfig c = a.config_path.empty() ? preset_config(a.preset) : load_config_file(a.config_path);
  if (a.hidden) c.hidden_size = *a.hidden;
  if (a.heads) c.num_heads = *a.heads;
  if (a.q_rank) c.q_lora_rank = *a.q_rank;
  if (a.kv_rank) c.kv_lora_rank = *a.kv_rank;
  if (a.nope) c.qk_nope_head_dim = *a.nope;
  if (a.rope) c.qk_rope_head_dim = *a.rope;
  if (a.value) c.v_head_dim = *a.value;
  if (a.gate) c.output_gate = true;
  c.validate();
  return c;
}

PlanReport plan_for_auto(const AutoPlanQuery& q) {
  Hardware hw;
  if (q.hardware.empty()) {
    CalibrationOptions options;
    options.dtypes = {q.dtype};
    options.seq_len = 512;
    options.repeats = 1;
    hw = calibrate_host(q.config, options);
  } else {
    hw = hardware_named(q.hardware);
  }
  PlanRequest r;
  r.config = q.config;
  r.seq_len = q.seq_len;
  r.batch = q.batch;
  r.dtype = q.dtype;
  r.cp = q.cp;
  r.tp = q.tp;
  if (q.strategy) r.strategies = {*q.strategy};
  if (q.ulysses) r.ulysses = *q.ulysses;
  if (q.partition) r.partitions = {*q.partition};
  if (q.overlap) r.overlaps = {*q.overlap};
  r.causal = q.causal;
  r.hardware = hw;
  // The run's emulated link (bench --bandwidth-gbps), on top of the hardware's: the calibrated
  // Gloo link, or a profile's or file's.
  r.emulated_link.bandwidth_bytes_per_s = q.bandwidth_gbps * 1e9;
  r.emulated_link.latency_s = q.latency_us * 1e-6;
  r.kv_recompute_when_short = q.cpu_run;
  r.memory_per_rank_bytes = q.memory_bytes_per_rank;
  PlanReport report = plan_context_parallel(r);
  MLACP_REQUIRE(report.any_feasible(), "plan", "--strategy/--ulysses auto found no feasible candidate",
                {got("reason", report.explanation)}, "fix the run's degrees or give the strategy");
  return report;
}

std::string auto_choice_text(const PlanReport& report) {
  std::ostringstream out;
  out << "auto: " << report.choice().label() << " (planner, " << report.summary << ")\n";
  std::istringstream lines(report.explanation);
  for (std::string line; std::getline(lines, line);) out << "auto:   " << line << "\n";
  return out.str();
}

std::vector<std::string> with_planned_flag(std::vector<std::string> argv, const std::string& flag) {
  if (std::find(argv.begin(), argv.end(), flag) == argv.end()) argv.push_back(flag);
  return argv;
}

std::vector<std::string> with_planned_choice(std::vector<std::string> argv,
                                             const std::vector<std::pair<std::string, std::string>>& values) {
  for (const auto& [flag, value] : values) {
    bool found = false;
    for (size_t i = 0; i < argv.size(); ++i) {
      if (argv[i] == flag && i + 1 < argv.size()) {
        argv[i + 1] = value;
        found = true;
      } else if (argv[i].rfind(flag + "=", 0) == 0) {
        argv[i] = flag + "=" + value;
        found = true;
      }
    }
    if (!found) argv.insert(argv.end(), {flag, value});
  }
  return argv;
}

int64_t parse_count(const std::string& what, const std::string& option, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  MLACP_REQUIRE(!text.empty() && end && *end == '\0' && errno == 0 && v >= 0 && v <= (int64_t{1} << 40), what,
                "--" + option + " must be a whole number >= 0 or auto", {got(option, text)},
                "pass e.g. --" + option + " 2, or --" + option + " auto");
  return v;
}

}  // namespace mlacp::tools
