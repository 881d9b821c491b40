// Calibration of the machine at hand (include/mlacp/planner.h, docs/DESIGN.md §15): one core's
// GEMM and attention rates and the layer's elementwise cost, measured with one intra-op thread
// (ranks of a host share its cores: the step model scales by cores / ranks).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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

}  // namespace

Hardware calibrate_host(const MlaConfig& config, const CalibrationOptions& options) {
  config.validate();
  MLACP_REQUIRE(options.seq_len >= 64 && options.seq_len <= 65536, "plan", "the calibration length must be in [64, 65536]",
                {got("seq", options.seq_len)}, "pass e.g. --calibrate-seq 1024");
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
              std::to_string(options.seq_len) + "), the layer's elementwise cost; link not measured";
  hw.cores_per_node = cores;
  hw.devices_per_node = 1 << 20;  // every local rank on this host
  hw.memory_bytes = available_host_memory().available_bytes;

  const int threads_before = at::get_num_threads();
  set_intra_op_threads(1);
  struct Restore {
    int threads;
    ~Restore() { set_intra_op_threads(threads); }
  } restore{threads_before};

  for (const std::string& dtype_name : options.dtypes) {
    // One process per core, forked before this dtype's first tensor; each sends its figures back.
    const long others = options.concurrent ? cores - 1 : 0;
    std::vector<std::pair<pid_t, int>> children;
    for (long i = 0; i < others; ++i) {
      int fds[2];
      MLACP_REQUIRE(pipe(fds) == 0, "plan", "calibration could not create a pipe", {}, "pass fewer processes");
      const pid_t pid = fork();
      if (pid == 0) {
        close(fds[0]);
        int status = 0;
        try {
          CalibrationOptions quiet = options;
          quiet.verbose = false;
          const std::vector<double> v = measure(config, quiet, dtype_name);
          const ssize_t n = static_cast<ssize_t>(v.size() * sizeof(double));
          status = write(fds[1], v.data(), static_cast<size_t>(n)) == n ? 0 : 1;
        } catch (...) {
          status = 1;
        }
        _exit(status);
      }
      close(fds[1]);
      MLACP_REQUIRE(pid > 0, "plan", "calibration could not start a process per core", {got("cores", cores)},
                    "retry, or calibrate with fewer processes");
      children.emplace_back(pid, fds[0]);
    }
    std::vector<std::vector<double>> all = {measure(config, options, dtype_name)};
    for (const auto& [pid, fd] : children) {
      std::vector<double> v(all.front().size());
      const ssize_t want = static_cast<ssize_t>(v.size() * sizeof(double));
      ssize_t got_bytes = 0;
      while (got_bytes < want) {
        const ssize_t n = read(fd, reinterpret_cast<char*>(v.data()) + got_bytes, static_cast<size_t>(want - got_bytes));
        if (n <= 0) break;
        got_bytes += n;
      }
      close(fd);
      int status = 0;
      waitpid(pid, &status, 0);
      if (got_bytes == want && WIFEXITED(status) && WEXITSTATUS(status) == 0) all.push_back(v);
    }
    MLACP_REQUIRE(static_cast<long>(all.size()) == others + 1, "plan", "a calibration process failed",
                  {got("answered", all.size()), got("started", others + 1)}, "retry the calibration");
    std::vector<double> median(all.front().size());
    for (size_t k = 0; k < median.size(); ++k) {
      std::vector<double> column;
      for (const auto& v : all) column.push_back(v[k]);
      std::sort(column.begin(), column.end());
      median[k] = column[column.size() / 2];
    }
    hw.rates[dtype_name] = rates_of(median);
  }
  return hw;
}

}  // namespace mlacp
