// `mlacp plan`: ranks every strategy x Ulysses degree x partition x overlap (x TP split) for a
// model, a sequence and a cluster, from a hardware profile, a hardware file or a calibration of
// this machine, and says why it chose what it chose (include/mlacp/planner.h, docs/DESIGN.md §15).
#include <cstdlib>
#include <iostream>

#include "commands.h"
#include "device_options.h"
#include "core/threads.h"
#include "mlacp/errors.h"
#include "mlacp/planner.h"
#include "output_file.h"
#include "option_checks.h"
#include "plan_command.h"

namespace mlacp::tools {

CLI::App* add_plan_command(CLI::App& app, PlanArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "plan", "choose strategy, Ulysses degree, partition, overlap (and tp x cp) for a model, S and a cluster");
  add_model_options(cmd, a.model);
  cmd->add_option("--seq", a.seq, "global sequence length")->check(int_range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--batch", a.batch, "sequences per CP group")->check(int_range(1, 1 << 20));
  cmd->add_option("--dtype", a.dtype, "bfloat16 (default) | float32 | float64");
  cmd->add_option("--gpus", a.devices, "devices to split into tp x cp (every split is a candidate; default 8 when neither --gpus nor --cp)")
      ->check(int_range(1, 1 << 20));
  cmd->add_option("--cp", a.cp, "fixed CP degree (instead of --gpus)")->check(int_range(1, 1 << 20));
  cmd->add_option("--tp", a.tp, "fixed TP degree, with --cp")->check(int_range(1, 1024));
  cmd->add_option("--strategy", a.strategies, "strategies to consider (default both)")->delimiter(',');
  cmd->add_option("--ulysses", a.ulysses, "fixed Ulysses degree (default: every U dividing P)")
      ->check(int_range(1, 1 << 20));
  cmd->add_option("--partition", a.partitions, "partitions to consider (default both)")->delimiter(',');
  cmd->add_option("--overlap", a.overlap, "on | off | both (default both)")->check(CLI::IsMember({"on", "off", "both"}));
  cmd->add_flag("!--no-causal", a.causal, "attention over every key (default causal)");
  cmd->add_option("--hardware", a.hardware,
                  "profile (h100-nvlink-ib, h200-nvlink-ib, h800-nvlink-ib) or a hardware file (default h200-nvlink-ib)")
      ->check(profile_or_input_file(hardware_profile_names()));
  cmd->add_flag("--calibrate", a.calibrate,
                "measure this machine instead (GEMM, attention kernel; the Gloo link and real CP steps on two local ranks)");
  cmd->add_option("--calibrate-seq", a.calibrate_seq, "sequence length of the calibration runs")
      ->check(int_range(64, 65536));
  cmd->add_flag("--calibrate-link", a.calibrate_link,
                "run by every rank of a world on several hosts (torchrun --nnodes N): --hardware's figures with the "
                "links inside a host and across hosts measured on the real network; rank 0 writes --save-hardware");
  cmd->add_option("--timeout", a.timeout_s, "--calibrate-link: seconds a rank waits for its peers")->check(int_range(1, 3600));
  cmd->add_option("--save-hardware", a.save_hardware, "write the hardware (calibrated or loaded) to this JSON file")
      ->check(output_file());
  cmd->add_flag("--show-hardware", a.show_hardware, "print the hardware's figures as JSON");
  cmd->add_option("--bandwidth-gbps", a.bandwidth_gbps,
                  "link bandwidth inside a node, GB/s per rank (overrides the hardware's, e.g. the real network's figure)")
      ->check(float_range(0.0, 1e6));
  cmd->add_option("--latency-us", a.latency_us, "link latency inside a node, microseconds (overrides the hardware)")
      ->check(float_range(0.0, 1e7));
  cmd->add_option("--inter-bandwidth-gbps", a.inter_bandwidth_gbps, "link bandwidth across nodes, GB/s per rank")
      ->check(float_range(0.0, 1e6));
  cmd->add_option("--emulated-gbps", a.emulated_gbps,
                  "bench's emulated link (its --bandwidth-gbps), GB/s: a transfer takes the longer of it and the hardware's "
                  "link")
      ->check(float_range(0.0, 1e6));
  cmd->add_option("--emulated-latency-us", a.emulated_latency_us, "bench's emulated link latency (its --latency-us)")
      ->check(float_range(0.0, 1e7));
  cmd->add_option("--rows", a.rows, "candidates shown in the table (--json has all)")->check(int_range(1, 100000));
  cmd->add_option("--json", a.json_path, "also write the report as JSON")->check(output_file());
  return cmd;
}

PlanRequest plan_request(const PlanArgs& a, const Hardware& hardware) {
  PlanRequest r;
  r.config = model_config(a.model);
  MLACP_REQUIRE(a.seq > 0, "plan", "the sequence length is required", {}, "pass --seq S");
  r.seq_len = a.seq;
  r.batch = a.batch;
  r.dtype = a.dtype;
  MLACP_REQUIRE(!(a.devices > 0 && a.cp > 0), "plan", "give --gpus or --cp, not both",
                {got("gpus", a.devices), got("cp", a.cp)}, "drop one of them");
  MLACP_REQUIRE(a.tp == 1 || a.cp > 0, "plan", "--tp goes with --cp (with --gpus every split is a candidate)",
                {got("tp", a.tp)}, "pass --cp P --tp T, or --gpus N");
  r.devices = a.devices;
  r.cp = a.cp;
  if (r.devices == 0 && r.cp == 0) r.devices = 8;
  r.tp = a.tp;
  for (const std::string& s : a.strategies) r.strategies.push_back(parse_strategy(s));
  r.ulysses = a.ulysses;
  for (const std::string& p : a.partitions) r.partitions.push_back(parse_partition(p));
  if (a.overlap == "on") r.overlaps = {true};
  if (a.overlap == "off") r.overlaps = {false};
  r.causal = a.causal;
  r.hardware = hardware;
  r.kv_recompute_when_short = hardware.cores_per_node > 0;  // CPU hardware: the CPU kernel's K/V recompute
  r.emulated_link.bandwidth_bytes_per_s = a.emulated_gbps * 1e9;
  r.emulated_link.latency_s = a.emulated_latency_us * 1e-6;
  return r;
}

Hardware plan_hardware(const PlanArgs& a) {
  Hardware hw;
  if (a.calibrate_link) {
    MLACP_REQUIRE(launched_as_rank() && !a.calibrate, "plan",
                  "--calibrate-link runs on every rank of a world on several hosts, started by torchrun, from a "
                  "hardware file (not with --calibrate)",
                  {got("RANK", std::getenv("RANK") ? std::getenv("RANK") : "unset"), got("calibrate", a.calibrate)},
                  "calibrate one host first (mlacp plan --calibrate --save-hardware host.json), then on every host: "
                  "torchrun --nnodes N ... --no-python mlacp plan --calibrate-link --hardware host.json --save-hardware "
                  "hosts.json --seq S");
    const Hardware base = hardware_named(a.hardware);
    const GroupOptions options = group_options_for(DeviceArgs{}, c10::Device(c10::DeviceType::CPU), a.timeout_s);
    Rendezvous rendezvous = Rendezvous::of(world_from_env(), options.timeout);
    hw = calibrate_hosts(rendezvous, base, options, 5, true);
  } else if (a.calibrate) {
    CalibrationOptions options;
    options.dtypes = {a.dtype};
    options.seq_len = a.calibrate_seq;
    options.verbose = true;
    hw = calibrate_host(model_config(a.model), options);
  } else {
    hw = hardware_named(a.hardware);
  }
  if (a.bandwidth_gbps) hw.intra_node.bandwidth_bytes_per_s = *a.bandwidth_gbps * 1e9;
  if (a.latency_us) hw.intra_node.latency_s = *a.latency_us * 1e-6;
  if (a.inter_bandwidth_gbps) hw.inter_node.bandwidth_bytes_per_s = *a.inter_bandwidth_gbps * 1e9;
  return hw;
}

int run_plan(const CommonArgs& common, const PlanArgs& a) {
  MLACP_REQUIRE(a.seq > 0, "plan", "the sequence length is required", {}, "pass --seq S");
  model_config(a.model);  // the model's rules before any calibration run
  const Hardware hw = plan_hardware(a);
  if (a.calibrate_link && world_from_env().rank != 0) return 0;  // rank 0 reports and writes
  if (!a.save_hardware.empty()) write_output_file("--save-hardware", a.save_hardware, hw.to_json() + "\n");
  if (a.show_hardware) std::cout << hw.to_json() << "\n";
  const PlanReport report = plan_context_parallel(plan_request(a, hw));
  std::cout << report.to_text(a.rows);
  if (!a.json_path.empty()) write_output_file("--json", a.json_path, report.to_json() + "\n");
  return report.any_feasible() ? 0 : kExitInvalidInput;
}

}  // namespace mlacp::tools
