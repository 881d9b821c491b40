// Calibration of the machine at hand (include/mlacp/planner.h, docs/DESIGN.md §15): one core's
// GEMM and attention rates measured with one intra-op thread (ranks of a host share its cores:
// the step model scales by cores / ranks), the real backend's link and the elementwise cost from
// short CP steps on two local ranks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/compat.h"
#include "core/host_memory.h"
#include "core/threads.h"
#include "kernels/blockwise_attention.h"
#include "mlacp/attention.h"
#include "mlacp/errors.h"
#include "mlacp/planner.h"
#include "mlacp/runtime.h"

namespace mlacp {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename F>
double median_seconds(int repeats, F&& run) {
  run();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const double start = now_s();
    run();
    t.push_back(now_s() - start);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

at::ScalarType dtype_of(const std::string& name) {
  if (name == "float64") return at::kDouble;
  if (name == "bfloat16") return at::kBFloat16;
  return at::kFloat;
}

// Projection-shaped GEMMs (tokens x latent rank x heads * head dim), as the layer runs them, at
// `tokens` rows.
double gemm_rate(at::ScalarType dtype, int64_t tokens, int repeats) {
  const int64_t shapes[][2] = {{1536, 3072}, {512, 4096}, {2048, 1024}};
  double flops = 0, seconds = 0;
  for (const auto& s : shapes) {
    at::Tensor a = at::randn({tokens, s[0]}).to(dtype), b = at::randn({s[0], s[1]}).to(dtype);
    at::Tensor c = at::empty({tokens, s[1]}, a.options());
    seconds += median_seconds(repeats, [&] { at::mm_out(c, a, b); });
    flops += 2.0 * static_cast<double>(tokens * s[0] * s[1]);
  }
  return flops / seconds;
}

constexpr int64_t kCurveTokens[] = {128, 512, 2048};

// The figures one process measures, as numbers in a fixed order (they cross a pipe).
std::vector<double> measure(const MlaConfig& config, const CalibrationOptions& options, const std::string& dtype_name);
ComputeRates rates_of(const std::vector<double>& v) {
  ComputeRates r;
  r.attention_forward_flops = v[0];
  r.attention_backward_flops = v[1];
  r.seconds_per_element = v[2];
  for (size_t i = 0; i < std::size(kCurveTokens); ++i)
    r.gemm_flops_by_tokens.emplace_back(static_cast<double>(kCurveTokens[i]), v[3 + i]);
  r.gemm_flops = r.gemm_flops_by_tokens.back().second;
  return r;
}

std::vector<double> measure(const MlaConfig& config, const CalibrationOptions& options, const std::string& dtype_name) {
  const at::ScalarType dtype = dtype_of(dtype_name);
  std::vector<double> gemm;
  for (int64_t tokens : kCurveTokens) gemm.push_back(gemm_rate(dtype, tokens, options.repeats));

  // The attention kernel in the runtime's layout ([B,S,H,D] viewed as [B,H,S,D]), causal.
  const int64_t S = options.seq_len, heads = 8;
  const int64_t dqk = config.qk_head_dim(), dv = config.v_head_dim;
  at::manual_seed(0);
  auto make = [&](int64_t d) { return at::randn({1, S, heads, d}).to(dtype).transpose(1, 2); };
  at::Tensor q = make(dqk), k = make(dqk), v = make(dv), dout = make(dv);
  AttentionStructure st;
  st.causal = true;
  st.query_token_index = at::arange(S, at::kLong);
  st.key_token_index = at::arange(S, at::kLong);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(dqk));
  BlockwiseResult fwd;
  const double t_fwd = median_seconds(options.repeats, [&] { fwd = blockwise_attention_forward(q, k, v, scaling, st); });
  const double t_bwd = median_seconds(options.repeats, [&] {
    blockwise_attention_backward(q, k, v, fwd.out, fwd.lse, dout, at::Tensor(), scaling, st);
  });
  const double pairs = static_cast<double>(S) * static_cast<double>(S + 1) / 2.0;
  const double attention_flops = 2.0 * static_cast<double>(heads) * pairs * static_cast<double>(dqk + dv);
  std::vector<double> out = {attention_flops / t_fwd, 2.5 * attention_flops / t_bwd, 0.0};
  out.insert(out.end(), gemm.begin(), gemm.end());

  if (options.cp_step) {  // the elementwise cost comes from the two-rank CP steps
    if (options.verbose)
      std::cerr << "calibrate: " << dtype_name << " GEMM " << gemm.front() / 1e9 << " / " << gemm.back() / 1e9
                << " GFLOP/s at " << kCurveTokens[0] << " / " << kCurveTokens[std::size(kCurveTokens) - 1]
                << " tokens; attention forward " << out[0] / 1e9 << ", backward " << out[1] / 1e9 << " GFLOP/s\n";
    return out;
  }
  // The layer on one device: what GEMMs and attention do not explain is elementwise work.
  const bool bf16 = dtype == at::kBFloat16;
  MlaAttention layer(config, at::TensorOptions().dtype(bf16 ? at::kFloat : dtype));
  at::Tensor x = at::randn({1, S, config.hidden_size}).to(bf16 ? at::kFloat : dtype).requires_grad_(true);
  at::Tensor w = at::randn({1, S, config.hidden_size});
  const double t_layer = median_seconds(options.repeats, [&] {
    for (auto& p : layer->parameters()) p.mutable_grad() = at::Tensor();
    x.mutable_grad() = at::Tensor();
    std::unique_ptr<compat::AutocastGuard> autocast;
    if (bf16) autocast = std::make_unique<compat::AutocastGuard>(c10::DeviceType::CPU, true, at::kBFloat16);
    at::Tensor y = layer->forward(x);
    (y.to(at::kFloat) * w).sum().backward();
  });
  PlanRequest one;
  one.config = config;
  one.seq_len = S;
  one.dtype = dtype_name;
  one.cp = 1;
  one.hardware.name = "calibration";
  one.hardware.rates[dtype_name] = rates_of(out);  // per element 0: GEMMs and attention only
  MeshShape shape;
  const CpPlan plan(plan_spec_for(config, shape, CpStrategy::latent_kv_head, CpPartition::contiguous, false));
  const CandidatePrediction modelled = predict_step(plan, one);
  out[2] = std::max(0.0, t_layer - modelled.compute_s) / modelled.activation_elements;
  if (options.verbose)
    std::cerr << "calibrate: " << dtype_name << " GEMM " << gemm.front() / 1e9 << " / " << gemm.back() / 1e9
              << " GFLOP/s at " << kCurveTokens[0] << " / " << kCurveTokens[std::size(kCurveTokens) - 1]
              << " tokens; attention forward " << out[0] / 1e9 << ", backward " << out[1] / 1e9
              << " GFLOP/s; layer forward+backward " << t_layer * 1e3 << " ms (GEMMs and attention "
              << modelled.compute_s * 1e3 << " ms): elementwise " << out[2] * 1e9 << " ns per activation element\n";
  return out;
}


// --- processes ---------------------------------------------------------------------------------

bool read_all(int fd, void* data, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = read(fd, static_cast<char*>(data) + done, bytes - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Runs work(i) for i in [0, count) in `count` forked processes at once and returns their figures
// in index order. The parent only waits: it holds no tensor or process group of theirs.
std::vector<std::vector<double>> in_processes(long count, const std::function<std::vector<double>(long)>& work,
                                              const std::string& what) {
  std::vector<std::pair<pid_t, int>> children;
  auto abandon = [&children] {
    for (const auto& [pid, fd] : children) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      close(fd);
    }
  };
  for (long i = 0; i < count; ++i) {
    int fds[2];
    if (pipe(fds) != 0) {
      abandon();
      MLACP_REQUIRE(false, "plan", "calibration could not create a pipe", {got("phase", what)}, "retry the calibration");
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      int status = 1;
      try {
        const std::vector<double> v = work(i);
        const uint64_t n = v.size();
        status = write(fds[1], &n, sizeof n) == static_cast<ssize_t>(sizeof n) &&
                         write(fds[1], v.data(), n * sizeof(double)) == static_cast<ssize_t>(n * sizeof(double))
                     ? 0
                     : 1;
      } catch (const std::exception& e) {
        std::cerr << "calibrate: " << what << " process " << i << ": " << e.what() << "\n";
      }
      _exit(status);
    }
    close(fds[1]);
    if (pid < 0) {
      close(fds[0]);
      abandon();
      MLACP_REQUIRE(false, "plan", "calibration could not start its processes",
                    {got("phase", what), got("processes", count)}, "retry the calibration");
    }
    children.emplace_back(pid, fds[0]);
  }
  std::vector<std::vector<double>> out;
  for (const auto& [pid, fd] : children) {
    uint64_t n = 0;
    std::vector<double> v;
    bool ok = read_all(fd, &n, sizeof n) && n < (1u << 20);
    if (ok) {
      v.resize(n);
      ok = read_all(fd, v.data(), n * sizeof(double));
    }
    close(fd);
    int status = 0;
    waitpid(pid, &status, 0);
    if (ok && WIFEXITED(status) && WEXITSTATUS(status) == 0) out.push_back(std::move(v));
  }
  MLACP_REQUIRE(static_cast<long>(out.size()) == count, "plan", "a calibration process failed",
                {got("phase", what), got("answered", out.size()), got("started", count)},
                "retry the calibration (a process's error, if it had one, is printed above)");
  return out;
}

// --- two local ranks over the real backend ----------------------------------------------------

struct CpCase {
  CpStrategy strategy;
  int64_t ulysses;
};
// The strategies' simplest forms at P = 2: latent (all-gather, U=1) and expanded (Ulysses, U=2).
std::vector<CpCase> cp_cases(const MlaConfig& config) {
  std::vector<CpCase> cases = {{CpStrategy::latent_kv_head, 1}};
  if (config.num_heads % 2 == 0) cases.push_back({CpStrategy::expanded_ulysses, 2});
  return cases;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

LinkLevel measure_link(const ParallelGroups& g, const CommGroup& group, int repeats, const std::string& verbose_label) {
  // All-gathers and all-to-alls of 64 KiB, 512 KiB and 4 MiB per rank (the sizes of a layer's
  // transfers) over `group`; latency and seconds per byte fitted by least squares over each kind,
  // then averaged over the two kinds (the step model has one figure per link level). A rank that
  // is not in the group times nothing but keeps the world's barriers.
  const int64_t rows[] = {64, 512, 4096};  // x 256 float32 per token
  double latency = 0, per_byte = 0;
  const bool member = group.defined() && group.size() > 1;
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<double> t, b;
    for (int64_t n : rows) {
      at::Tensor x = at::zeros({1, n, 2, 128}, at::kFloat);
      g.instruments.counters->reset();
      std::vector<double> times;
      for (int r = 0; r < repeats + 3; ++r) {
        barrier(g.world);
        const double start = now_s();
        if (member) {
          if (kind == 0)
            launch_all_gather_seq(group, x, "calibration").wait();
          else
            launch_seq_to_head(group, x, "calibration").wait();
        }
        const double slower = all_reduce_max(g.world, {member ? now_s() - start : 0.0})[0];
        if (r > 1) times.push_back(slower);  // two warm-ups
      }
      // Bytes one member sends (the same on every member; a world-wide max reaches the others)
      double sent = 0;
      if (member) {
        const CommTotals total = g.instruments.counters->by_label().at("calibration");
        sent = static_cast<double>(total.bytes) / static_cast<double>(total.calls);
      }
      b.push_back(all_reduce_max(g.world, {sent})[0]);
      t.push_back(median_of(times));
    }
    const double mb = (b[0] + b[1] + b[2]) / 3, mt = (t[0] + t[1] + t[2]) / 3;
    double num = 0, den = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      num += (b[i] - mb) * (t[i] - mt);
      den += (b[i] - mb) * (b[i] - mb);
    }
    const double slope = num > 0 ? num / den : t.back() / b.back();
    per_byte += slope / 2;
    latency += std::max(0.0, mt - slope * mb) / 2;
    if (!verbose_label.empty())
      std::cerr << "calibrate: " << verbose_label << " " << (kind == 0 ? "all-gather" : "all-to-all") << ": "
                << t[0] * 1e3 << " / " << t[1] * 1e3 << " / " << t[2] * 1e3 << " ms for " << b[0] / 1024 << " / "
                << b[1] / 1024 << " / " << b[2] / 1024 << " KiB per rank\n";
  }
  LinkLevel link;
  link.latency_s = latency;
  link.bandwidth_bytes_per_s = 1.0 / per_byte;
  return link;
}

namespace {

// One of the two ranks. Returns [link latency s, link bandwidth B/s, then per dtype and CP case
// the step's seconds (the slower rank's, median)].
std::vector<double> two_rank_figures(long rank, const std::string& store, const MlaConfig& config,
                                     const CalibrationOptions& options, long cores) {
  const long threads = std::max<long>(1, cores / 2);
  cpu_set_t set;
  CPU_ZERO(&set);
  for (long t = 0; t < threads; ++t) CPU_SET(static_cast<int>((rank * threads + t) % cores), &set);
  sched_setaffinity(0, sizeof set, &set);  // as the launcher pins its local ranks; best effort
  set_intra_op_threads(static_cast<int>(threads));
  use_batch_scheduling();  // as bench runs its ranks (Gloo's threads do not preempt the computation)
  WorldInfo world;
  world.rank = rank;
  world.size = 2;
  world.local_rank = rank;
  world.store_file = store;
  GroupOptions group_options;
  group_options.timeout = std::chrono::milliseconds(120000);
  Rendezvous rendezvous = Rendezvous::file(store, world, group_options.timeout);
  std::vector<double> out;
  {
    ParallelGroups g = rendezvous.groups(MeshShape{1, 2, 1, 2}, group_options);
    const LinkLevel link = measure_link(g, g.cp, options.repeats, options.verbose && rank == 0 ? "link" : "");
    out.push_back(link.latency_s);
    out.push_back(link.bandwidth_bytes_per_s);
  }
  const int64_t S = options.seq_len;
  for (const std::string& dtype_name : options.dtypes) {
    const at::ScalarType dtype = dtype_of(dtype_name);
    const bool bf16 = dtype == at::kBFloat16;
    const at::ScalarType param = bf16 ? at::kFloat : dtype;
    for (const CpCase& c : cp_cases(config)) {
      ParallelGroups g = rendezvous.groups(MeshShape{1, 2, 1, c.ulysses}, group_options);
      at::manual_seed(0);  // the same parameters on both ranks
      MlaAttention layer(config, at::TensorOptions().dtype(param));
      parallelize(layer, g, {c.strategy, CpPartition::head_tail, false});
      at::manual_seed(1 + rank);
      at::Tensor x = at::randn({1, S / 2, config.hidden_size}).to(param).requires_grad_(true);
      at::Tensor w = at::randn({1, S / 2, config.hidden_size});
      std::vector<double> times;
      for (int r = 0; r < options.repeats + 1; ++r) {
        for (auto& p : layer->parameters()) p.mutable_grad() = at::Tensor();
        x.mutable_grad() = at::Tensor();
        barrier(g.world);
        const double start = now_s();
        {
          std::unique_ptr<compat::AutocastGuard> autocast;
          if (bf16) autocast = std::make_unique<compat::AutocastGuard>(c10::DeviceType::CPU, true, at::kBFloat16);
          at::Tensor y = layer->forward(x);
          (y.to(at::kFloat) * w).sum().backward();
        }
        const double slower = all_reduce_max(g.world, {now_s() - start})[0];
        if (r > 0) times.push_back(slower);  // the first is a warm-up
      }
      out.push_back(median_of(times));
    }
  }
  return out;
}

}  // namespace

Hardware calibrate_hosts(Rendezvous& rendezvous, const Hardware& base, const GroupOptions& options, int repeats,
                         bool verbose) {
  const Topology& t = rendezvous.topology();
  const int64_t world = rendezvous.world().size, hosts = t.hosts();
  const int64_t per_host = hosts > 0 ? world / hosts : world;
  MLACP_REQUIRE(hosts >= 2, "plan", "--calibrate-link measures the links between hosts: the world must span two or more",
                {got("hosts", hosts), got("world_size", world)},
                "start the ranks on every host (torchrun --nnodes N); one host's link is --calibrate's");
  MeshShape grid{1, world, 1, per_host};
  MLACP_REQUIRE(world % hosts == 0 && host_local_ulysses(MeshShape{1, world, 1, 0}, t) == per_host, "plan",
                "--calibrate-link needs every host to hold the same number of consecutive ranks",
                {got("hosts", t.describe())}, "start the same --nproc_per_node on every host, as torchrun assigns them");
  ParallelGroups g = rendezvous.groups(grid, options);
  const bool lead = rendezvous.world().rank == 0;
  Hardware hw = base;
  if (per_host >= 2) hw.intra_node = measure_link(g, g.ulysses, repeats, verbose && lead ? "inside a host" : "");
  hw.inter_node = measure_link(g, g.all_gather, repeats, verbose && lead ? "across hosts" : "");
  hw.devices_per_node = per_host;
  hw.shared_node_link = 1;  // the host's ranks share its network interface (Gloo over TCP)
  cpu_set_t set;
  if (hw.cores_per_node > 0 && sched_getaffinity(0, sizeof set, &set) == 0)  // the cores a host's ranks share
    hw.cores_per_node = std::min<int64_t>(hw.cores_per_node, CPU_COUNT(&set));
  hw.name = base.name + ", links of " + std::to_string(hosts) + " hosts x " + std::to_string(per_host) + " ranks";
  hw.source = base.source + "; mlacp plan --calibrate-link on " + t.describe() +
              ": all-gathers and all-to-alls of 64 KiB to 4 MiB inside a host (intra_node) and across hosts "
              "(inter_node), every group of a kind at once";
  return hw;
}

Hardware calibrate_host(const MlaConfig& config, const CalibrationOptions& options) {
  config.validate();
  MLACP_REQUIRE(options.seq_len >= 64 && options.seq_len <= 65536 && options.seq_len % 4 == 0, "plan",
                "the calibration length must be a multiple of 4 in [64, 65536] (two ranks, head_tail: 4 chunks)",
                {got("seq", options.seq_len)}, "pass e.g. --calibrate-seq 1024");
  MLACP_REQUIRE(options.repeats >= 1 && options.repeats <= 1000, "plan", "the calibration repeats must be in [1, 1000]",
                {got("repeats", options.repeats)}, "pass e.g. 5");
  for (const std::string& d : options.dtypes)
    MLACP_REQUIRE(d == "float32" || d == "bfloat16" || d == "float64", "plan", "dtype must be float32, bfloat16 or float64",
                  {got("dtype", d)}, "pass --dtype float32");
  const long cores = std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
  Hardware hw;
  char host[256] = "this host";
  gethostname(host, sizeof host - 1);
  hw.name = std::string("calibrated on ") + host;
  hw.source = "mlacp plan --calibrate: per core, all " + std::to_string(cores) +
              " cores at once: GEMMs of projection shape at 128-2048 tokens, blockwise attention (causal, S=" +
              std::to_string(options.seq_len) + "); " +
              (options.cp_step ? "two local ranks over Gloo: the link (all-gathers and all-to-alls of 64 KiB to 4 MiB) and real CP steps "
                                 "(latent U=1, expanded U=2) for the elementwise cost"
                               : "the layer's elementwise cost on one device; link not measured");
  hw.cores_per_node = cores;
  hw.devices_per_node = 1 << 20;  // every local rank on this host
  hw.memory_bytes = available_host_memory().available_bytes;
  const std::vector<CpCase> cases = cp_cases(config);

  // The two ranks first, forked before this process makes any tensor.
  std::vector<double> two_ranks;
  if (options.cp_step) {
    std::string dir = (std::filesystem::temp_directory_path() / "mlacp-calibrate-XXXXXX").string();
    MLACP_REQUIRE(mkdtemp(dir.data()) != nullptr, "plan", "calibration could not create a private folder for its store",
                  {got("folder", dir)}, "set TMPDIR to a writable folder");
    struct RemoveDir {
      std::string path;
      ~RemoveDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
      }
    } remove_dir{dir};
    const std::string store = dir + "/store";
    two_ranks = in_processes(
        2, [&](long rank) { return two_rank_figures(rank, store, config, options, cores); }, "two-rank")[0];
    hw.intra_node.latency_s = two_ranks[0];
    hw.intra_node.bandwidth_bytes_per_s = two_ranks[1];
    if (options.verbose)
      std::cerr << "calibrate: link (Gloo, two local ranks): latency " << two_ranks[0] * 1e6 << " us, bandwidth "
                << two_ranks[1] / 1e9 << " GB/s\n";
  }

  const int threads_before = at::get_num_threads();
  set_intra_op_threads(1);
  struct Restore {
    int threads;
    ~Restore() { set_intra_op_threads(threads); }
  } restore{threads_before};

  for (size_t d = 0; d < options.dtypes.size(); ++d) {
    const std::string& dtype_name = options.dtypes[d];
    std::vector<std::vector<double>> all;
    if (options.concurrent) {  // one process per core, all at once
      all = in_processes(
          cores,
          [&](long i) {
            CalibrationOptions quiet = options;
            quiet.verbose = options.verbose && i == 0;
            return measure(config, quiet, dtype_name);
          },
          "per-core");
    } else {
      all = {measure(config, options, dtype_name)};
    }
    std::vector<double> median(all.front().size());
    for (size_t k = 0; k < median.size(); ++k) {
      std::vector<double> column;
      for (const auto& v : all) column.push_back(v[k]);
      median[k] = median_of(column);
    }
    ComputeRates rates = rates_of(median);
    if (options.cp_step) {
      // What the rates and the measured link do not explain of the real CP steps.
      rates.seconds_per_element = 0;
      hw.rates[dtype_name] = rates;
      PlanRequest request;
      request.config = config;
      request.seq_len = options.seq_len;
      request.dtype = dtype_name;
      request.cp = 2;
      request.hardware = hw;
      double per_element = 0;
      for (size_t k = 0; k < cases.size(); ++k) {
        const CpCase& c = cases[k];
        const CpPlan plan(plan_spec_for(config, MeshShape{1, 2, 1, c.ulysses}, c.strategy, CpPartition::head_tail, false));
        const CandidatePrediction p = predict_step(plan, request);
        const double measured = two_ranks.at(2 + d * cases.size() + k);
        per_element += (measured - p.step_s) / p.activation_elements / static_cast<double>(cases.size());
        if (options.verbose)
          std::cerr << "calibrate: " << dtype_name << " CP step " << p.label() << ": measured " << measured * 1e3
                    << " ms, GEMMs + attention + link " << p.step_s * 1e3 << " ms\n";
      }
      rates.seconds_per_element = std::max(0.0, per_element);
      if (options.verbose)
        std::cerr << "calibrate: " << dtype_name << " elementwise " << rates.seconds_per_element * 1e9
                  << " ns per activation element\n";
    }
    hw.rates[dtype_name] = rates;
  }
  return hw;
}

}  // namespace mlacp
