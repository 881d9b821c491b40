// The planner: which strategy, Ulysses degree, partition, overlap and TP x CP split to run for a
// model, a sequence and a cluster, predicted from the plan's byte formulas, the schedules' own
// overlap declarations and the hardware's rates, and explained (docs/DESIGN.md §15).
//
//   PlanRequest request;
//   request.config = preset_config("deepseek-v3");
//   request.seq_len = 131072; request.devices = 8;
//   request.hardware = hardware_profile("h200-nvlink-ib");
//   PlanReport report = plan_context_parallel(request);   // pure arithmetic: no tensors
//   std::cout << report.to_text();                        // ranked table, the choice and why
//
// What it models, per rank and per layer, forward + backward: every projection GEMM and the
// attention kernel (FLOPs / the hardware's rates; the causal load of the busiest Ulysses group of
// the partition), the elementwise work (a calibrated cost per activation element), each
// collective on the link level its group spans (latency + bytes / bandwidth), and, with overlap
// on, how much of each declared transfer the computation it is placed under can hide.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "mlacp/comm.h"
#include "mlacp/config.h"
#include "mlacp/memory.h"
#include "mlacp/plan.h"

namespace mlacp {

// Achieved rates of one device (CPU hosts: of one core) for one dtype.
struct ComputeRates {
  double gemm_flops = 0;                 // projection-shaped GEMMs, FLOP/s (at many tokens)
  // Measured GEMM rate by the GEMM's token count (rows), ascending; between and beyond the
  // points the rate is interpolated in log(tokens) and held at the ends. Empty: gemm_flops.
  std::vector<std::pair<double, double>> gemm_flops_by_tokens;
  double attention_forward_flops = 0;    // the attention kernel, forward, FLOP/s
  double attention_backward_flops = 0;   // its backward (2.5x the forward's FLOPs), FLOP/s
  double seconds_per_element = 0;        // elementwise work (norms, RoPE, copies, autograd), per
                                         // activation element of a forward + backward
};

struct LinkLevel {
  double bandwidth_bytes_per_s = 0;  // per rank, one direction; 0: not modelled (free)
  double latency_s = 0;              // per collective
};

struct Hardware {
  std::string name;
  std::string source;                          // where the figures come from
  std::map<std::string, ComputeRates> rates;   // by dtype: "float32", "bfloat16", "float64"
  int64_t devices_per_node = 8;
  int64_t cores_per_node = 0;  // CPU hosts: the ranks of a node share these cores and the rates
                               // are per core; 0: each rank has its own device
  double memory_bytes = 0;     // per device (CPU hosts: per node, shared by its ranks)
  LinkLevel intra_node, inter_node;  // inter_node: a rank's share when every rank of its node crosses at once
  // How the node's network is shared: 0, each device has its own (a GPU's rail: a flow across
  // nodes gets inter_node whatever the others do); 1, the node's ranks share one link (CPU hosts,
  // --calibrate-link): a ring with m members on a node crosses it with node/m flows at once, each
  // getting m x inter_node (docs/DESIGN.md §15).
  int64_t shared_node_link = 0;

  std::string to_json() const;
  static Hardware from_json(const std::string& text);  // throws mlacp::Error naming the bad field
};

// Named profiles whose figures cite their source: "h100-nvlink-ib", "h200-nvlink-ib",
// "h800-nvlink-ib".
std::vector<std::string> hardware_profile_names();
Hardware hardware_profile(const std::string& name);
Hardware load_hardware_file(const std::string& path);
// A profile by name, else a hardware file; neither is an error naming the profiles.
Hardware hardware_named(const std::string& profile_or_path);

struct PlanRequest {
  MlaConfig config;
  int64_t seq_len = 0;   // global S
  int64_t batch = 1;     // sequences per CP group
  std::string dtype = "bfloat16";
  // The world: either `devices` to split into tp x cp (every split with tp dividing the heads and
  // fitting in a node is a candidate), or fixed `cp` (and `tp`).
  int64_t devices = 0;
  int64_t cp = 0, tp = 1;
  std::vector<CpStrategy> strategies;    // empty: both
  int64_t ulysses = 0;                   // 0: every U dividing P
  std::vector<CpPartition> partitions;   // empty: both
  std::vector<bool> overlaps;            // empty: off and on
  // The latent strategy's K/V recompute (CpPlanSpec::kv_recompute: K/V of one head sub-block at a
  // time, expanded again in the backward, one more kv_b_proj pass; the CPU blockwise kernel's): a
  // latent candidate whose layer does not fit in the hardware's memory is also tried with it.
  // Set it for a run whose tensors are on the CPU; false: never.
  bool kv_recompute_when_short = false;
  // The memory a rank may use, in place of the hardware's (a CPU host's memory_bytes over its
  // ranks, a device's own): e.g. the run's memory limit over the host's ranks. 0: the hardware's.
  double memory_per_rank_bytes = 0;
  AttentionKernel kernel = AttentionKernel::blockwise;
  bool causal = true;
  Hardware hardware;
  // `mlacp bench`'s emulated link (--bandwidth-gbps / --latency-us), on top of the hardware's: a
  // collective then takes the longer of the two (LinkModel in include/mlacp/comm.h: the real
  // transfer runs, the wait ends no earlier than the emulated time). Zero: none.
  LinkLevel emulated_link;
};

// One collective of a candidate's step.
struct TransferPrediction {
  std::string name;     // transfer name ("latent", "dq", ...), as the byte counters label it
  double bytes = 0;     // one rank sends
  double seconds = 0;   // latency + bytes / bandwidth of its group's link level
  double hidden_s = 0;  // of it, under computation (overlap on)
};

// One candidate's prediction. Times are per step of one layer (forward + backward), on the
// critical path: the busiest rank.
struct CandidatePrediction {
  CpPlanSpec spec;
  bool feasible = true;
  std::string infeasible_reason;  // the rule it breaks, or the memory it needs
  double step_s = 0;
  double compute_s = 0;        // every phase below
  double comm_s = 0;           // every collective, as if nothing were hidden
  double exposed_comm_s = 0;   // what the computation does not hide
  double upprojection_s = 0;   // kv_b_proj forward + backward (the latent's repeated up-projection)
  double bytes_per_rank = 0;   // sent, forward + backward (docs/DESIGN.md §4.6)
  double memory_bytes = 0;     // one layer's peak (include/mlacp/memory.h)
  double activation_elements = 0;  // what the elementwise cost is charged on (one rank's forward)
  std::vector<std::pair<std::string, double>> phases;     // compute phase (timeline span) -> s
  std::vector<TransferPrediction> transfers;
  std::string label() const;  // "latent_kv_head U=2 head_tail overlap" (+ " tp=2" when tp > 1)
};

struct PlanReport {
  std::vector<CandidatePrediction> candidates;  // feasible ones fastest first, then the rest
  size_t chosen = 0;                            // index of the choice (the fastest feasible)
  std::string explanation;                      // why, in words, with the numbers that decided
  std::string summary;                          // the request in one line
  bool any_feasible() const { return !candidates.empty() && candidates.front().feasible; }
  const CandidatePrediction& choice() const { return candidates.at(chosen); }
  std::string to_text(size_t max_rows = 24) const;
  std::string to_json() const;
};

// Ranks every candidate of the request. Throws mlacp::Error for a request that is invalid as a
// whole (no sequence length, no world, an unknown dtype of the hardware); a candidate that breaks a
// plan rule or does not fit in memory is listed as infeasible with the reason.
PlanReport plan_context_parallel(const PlanRequest& request);

// One candidate (a plan that passed its own validation).
CandidatePrediction predict_step(const CpPlan& plan, const PlanRequest& request);

// Elements one rank sends in one transfer of the plan (by transfer name: "q", "k", "v", "kv",
// "qkv", "kv_gather", "latent", "o" and their gradients "dq", ..., "dO"); 0 when the plan has no
// such transfer. The per-kind sums are expected_comm_elements().
int64_t transfer_elements(const CpPlan& plan, int64_t batch, int64_t seq_len, const std::string& transfer);

// Calibration of the machine at hand (CPU), docs/DESIGN.md §15:
//  1. per core, every core at once (one process per core, forked before any tensor exists, as
//     the ranks of a host run: the rates include what they take from each other; the median over
//     the processes is kept): GEMMs of projection shape at 128-2048 tokens and the blockwise
//     kernel's causal forward and backward, for each dtype;
//  2. with `cp_step`, two local ranks over the real backend (Gloo on loopback, a private
//     FileStore): the link (all-gathers and all-to-alls of 64 KiB to 4 MiB: latency and
//     bandwidth, into Hardware::intra_node) and a short real CP step of each strategy (latent U=1, expanded U=2,
//     overlap off) at `seq_len`; what the rates and the link do not explain of those steps is the
//     elementwise cost per activation element (the schedules' copies, reorders and autograd
//     included). Without it (no fork allowed, e.g. inside Python): one single-device forward +
//     backward of the layer gives the elementwise cost, and the link is not measured.
struct CalibrationOptions {
  std::vector<std::string> dtypes = {"float32"};
  int64_t seq_len = 1024;  // of the layer and kernel runs (a multiple of 4)
  int repeats = 5;  // timed runs per figure (median), after one warm-up
  bool concurrent = true;  // one process per core (false: this process alone)
  bool cp_step = true;     // two local ranks: the link and real CP steps (false: single device)
  bool verbose = false;
};
// The GEMM rate of `rates` for a GEMM of `tokens` rows.
double gemm_rate_at(const ComputeRates& rates, double tokens);
Hardware calibrate_host(const MlaConfig& config, const CalibrationOptions& options);

// The link of `group`, a group of the set `g`: all-gathers and all-to-alls of 64 KiB-4 MiB a rank,
// every group of its kind at once (as a step's transfers run); latency and bandwidth a rank by
// least squares. Every rank of g.world calls it (a rank outside `group` keeps the barriers).
LinkLevel measure_link(const ParallelGroups& g, const CommGroup& group, int repeats,
                       const std::string& verbose_label = "");
// The links of a world on several hosts (every rank calls it, e.g. under torchrun): `base`'s
// compute figures (a host's calibration) with the link inside a host (the Ulysses groups of the
// hosts' ranks) and across hosts (one rank a host) measured on the real network, devices_per_node
// = the ranks a host, and cores_per_node no more than the cores a rank may run on. The hosts must
// hold the same number of consecutive ranks (as torchrun assigns them). docs/DESIGN.md §15.
Hardware calibrate_hosts(Rendezvous& rendezvous, const Hardware& base, const GroupOptions& options, int repeats,
                         bool verbose);

}  // namespace mlacp
