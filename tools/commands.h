// The subcommands of `mlacp`. Each registers its options on the CLI11 app and runs from them.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/host_allocator.h"
#include "device_options.h"

namespace mlacp::tools {

// Exit codes (README "Exit codes"); a rank killed by signal N gives 128 + N through the launcher.
constexpr int kExitCheckFailed = 1;   // verify: a check failed; train --compare: the curves disagree
constexpr int kExitInvalidInput = 2;  // an input broke a rule (rejected before any rank starts, or
                                      // before the first collective)
constexpr int kExitInternal = 3;      // an error mlacp did not diagnose (a bug: please report it)
constexpr int kExitFault = 4;         // a fault while running: a peer died or stalled, memory ran
                                      // out, a file could not be read

struct CommonArgs {
  int threads = 0;  // 0: all cores of this host, divided among local ranks
  bool pin_cores = false;  // pin local rank r to its own block of cores (benchmarks on small hosts)
  bool batch_scheduling = false;  // ranks under SCHED_BATCH (core/threads.h)
  std::string memory_limit;       // --memory-limit: "" (90% of available), "off" or GiB (memory_check.h)
  std::string iface;              // --iface: the interfaces Gloo binds under torchrun (GLOO_SOCKET_IFNAME)
  std::vector<std::string> argv;  // the whole command line (for re-launching ranks)
};

struct InfoArgs {
  int64_t gemm_size = 2048;
  bool skip_gemm = false;
};
CLI::App* add_info_command(CLI::App& app, InfoArgs& args);
int run_info(const CommonArgs& common, const InfoArgs& args);

// An ad-hoc verification case: every field optional, defaults from the tiny preset.
struct AdHocCase {
  std::string preset = "tiny";
  std::string config_path;
  std::optional<int64_t> hidden, heads, q_rank, kv_rank, nope, rope, value;
  std::optional<int64_t> seq, batch, dp, cp, tp, band, seed;
  std::optional<std::string> ulysses;  // a number, or "auto" (the planner's choice)
  std::string plan_hardware;           // with auto: a profile or hardware file ("": calibrate)
  std::optional<std::string> strategy, partition, dtype;
  std::optional<bool> causal;
  std::vector<int64_t> doc_ends, masked_rows;
  std::vector<std::string> frozen;
  bool gate = false;
  std::optional<bool> overlap;
  std::optional<std::string> kernel, reference_kernel;
  bool reference_rank0 = false;
  bool kv_recompute = false;     // latent strategy: K/V expanded per head sub-block (CpPlanSpec::kv_recompute)
  std::string checkpoint;         // HuggingFace checkpoint folder: its config and one layer's weights
  std::optional<int64_t> layer;   // that layer (default 0)
  bool preset_given = false;      // --preset was on the command line
  bool given = false;  // set when any of the above was on the command line
};

struct VerifyArgs {
  std::vector<std::string> cases;  // empty: the default matrix
  bool list = false;
  bool single_device = false;
  int nproc = 4;
  int timeout_s = 60;
  std::string json_path;
  AdHocCase adhoc;
  DeviceArgs device;  // --device, --backend
};
CLI::App* add_verify_command(CLI::App& app, VerifyArgs& args);
int run_verify(const CommonArgs& common, const VerifyArgs& args);

struct BenchArgs {
  int nproc = 2;
  std::vector<std::string> strategies;  // or {"auto"}: the planner's choice (plan_command.h)
  std::string ulysses = "0";            // a number, or "auto"
  std::string plan_hardware;            // with auto: profile or hardware file ("": calibrate this host)
  // Default case: DeepSeek-V3's attention dims (q rank 1536, kv rank 512, nope 128, rope 64,
  // value 128) with 16 heads and hidden 1024, so a step takes a fraction of a second here.
  int64_t seq = 512, batch = 1, hidden = 1024, heads = 16, q_rank = 1536, kv_rank = 512;
  int64_t nope = 128, rope = 64, value = 128;
  bool gate = false;
  std::string dtype = "float32";
  int steps = 31, warmup = 3;
  double bandwidth_gbps = 0.0, latency_us = 0.0;
  bool auto_link = false;
  double transfer_fraction = 0.5;
  bool pin = true;
  bool batch_scheduling = true;  // ranks under SCHED_BATCH (--no-batch-sched: default scheduler)
  bool kv_recompute = false;     // latent strategy: K/V expanded per head sub-block, again in the backward
  std::string json_path, trace_dir;
  int timeout_s = 120;
  DeviceArgs device;  // --device, --backend
};
CLI::App* add_bench_command(CLI::App& app, BenchArgs& args);
int run_bench(const CommonArgs& common, const BenchArgs& args);

// Applies --threads (0 = cores / local ranks) to LibTorch's intra-op pool.
void apply_threads(const CommonArgs& common);
// The intra-op threads each of `ranks_here` local ranks runs (what apply_threads sets in them).
int rank_threads(const CommonArgs& common, int64_t ranks_here);
// True when this process is one rank of a launch (torchrun's RANK or mlacp's launcher).
bool launched_as_rank();
// What main() set up for the host allocator (core/host_allocator.h), for `mlacp info`.
mlacp::HostAllocatorPolicy& host_allocator_policy();
// Re-runs this command line on `nproc` local ranks (without --nproc); returns the exit status.
int relaunch_local(const CommonArgs& common, int nproc);

}  // namespace mlacp::tools
