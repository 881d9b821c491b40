// `mlacp bench-kernel`: see kernel_bench.h.
#include "kernel_bench.h"
#include "memory_check.h"

#include "output_file.h"
#include "option_checks.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <sys/resource.h>

#include "core/memory_probe.h"
#include "kernels/blockwise_attention.h"
#include "kernels/gemm_rate.h"
#include "kernels/torch_sdpa.h"
#include "mlacp/errors.h"
#include "table.h"

namespace mlacp::tools {
namespace {

// Useful-FLOP convention (flash-attention's): backward = 2.5 × forward.
constexpr double kBackwardFactor = 2.5;
constexpr const char* kConvention =
    "forward = 2*B*H*S*S*(Dqk+Dv) (causal: half); backward = 2.5 x forward; forward+backward = 3.5 x forward";
constexpr double kMiB = 1024.0 * 1024.0;

struct Row {
  int64_t seq = 0;
  std::string dtype, mask, pass, path, layout;
  double median_ms = 0, gflops = 0, gemm_gflops = 0;
  int64_t peak_extra_bytes = 0;   // highest live tensor bytes above the call's start
  int64_t temporaries_bytes = 0;  // the same minus the results (out, and dq/dk/dv for backward)
  int64_t tiles_computed = 0, tiles_total = 0;
  double cpu_busy = 0;  // process CPU time / (wall × threads), median over repeats: < ~0.9 means
                        // other processes took cores and every rate of the row is depressed
  // --vs-torch: torch's SDPA on the same operands, its calls alternating with the kernel's
  std::string torch_backend;
  double torch_median_ms = 0, torch_gflops = 0;
  int64_t torch_peak_extra_bytes = 0;
  double torch_max_diff = 0;  // max |out_torch - out_mlacp| / max |out_mlacp| (last repeat)
};

// The tolerance of the --vs-torch output check: the two kernels sum in different orders.
double torch_tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-4 : 3e-2; }

double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

at::ScalarType dtype_of(const std::string& name) { return name == "float32" ? at::kFloat : at::kBFloat16; }

double forward_flops(const KernelBenchArgs& a, int64_t s, bool causal) {
  const double full = 2.0 * a.batch * a.heads * static_cast<double>(s) * static_cast<double>(s) *
                      static_cast<double>(a.dqk + a.dv);
  return causal ? full / 2 : full;
}

AttentionStructure structure_for(int64_t s, bool causal) {
  AttentionStructure st;
  st.causal = causal;
  st.query_token_index = at::arange(s, at::kLong);
  st.key_token_index = at::arange(s, at::kLong);
  return st;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const std::vector<std::pair<std::string, BlockwisePath>> kPaths = {
    {"automatic", BlockwisePath::automatic},
    {"float32_portable", BlockwisePath::float32_portable},
    {"float32_avx512", BlockwisePath::float32_avx512},
    {"float32_avx2", BlockwisePath::float32_avx2},
    {"bf16_avx512", BlockwisePath::bf16_avx512},
    {"bf16_via_f32_avx512", BlockwisePath::bf16_via_f32_avx512},
    {"bf16_via_f32_avx2", BlockwisePath::bf16_via_f32_avx2},
    {"bf16_amx", BlockwisePath::bf16_amx}};

BlockwisePath path_of(const std::string& name) {
  for (const auto& [n, p] : kPaths)
    if (n == name) return p;
  return BlockwisePath::automatic;
}

// Whether a forced path computes this dtype (bf16 paths: bfloat16; float32 paths: float32).
bool computes(const std::string& path, const std::string& dtype) {
  if (path == "automatic") return true;
  return (path.rfind("bf16", 0) == 0) == (dtype == "bfloat16");
}

Row bench_case(const KernelBenchArgs& a, int64_t s, const std::string& dtype_name, const std::string& mask,
               bool backward, double gemm_gflops, BlockwisePath path, const std::string& layout) {
  const at::ScalarType dtype = dtype_of(dtype_name);
  const bool causal = mask == "causal";
  at::manual_seed(0);
  // [B,H,S,D] values in either memory layout (bshd: a [B,S,H,D] tensor transposed).
  auto make = [&](int64_t d) {
    if (layout == "bshd") return at::randn({a.batch, s, a.heads, d}).to(dtype).transpose(1, 2);
    return at::randn({a.batch, a.heads, s, d}).to(dtype);
  };
  at::Tensor q = make(a.dqk).requires_grad_(backward);
  at::Tensor k = make(a.dqk).requires_grad_(backward);
  at::Tensor v = make(a.dv).requires_grad_(backward);
  at::Tensor dout = backward ? make(a.dv) : at::Tensor();
  const AttentionStructure st = structure_for(s, causal);
  BlockwiseStats stats;
  BlockwiseOptions opt;
  opt.block_q = a.block_q, opt.block_k = a.block_k, opt.stats = &stats, opt.path = path;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(a.dqk));
  Row row;
  row.seq = s, row.dtype = dtype_name, row.mask = mask, row.pass = backward ? "fwd+bwd" : "fwd";
  row.layout = layout;
  std::vector<double> times_ms, busy, torch_ms;
  if (a.vs_torch) row.torch_backend = torch_sdpa_backend(q.detach(), k.detach(), v.detach(), scaling, causal);
  for (int r = 0; r < a.repeats; ++r) {
    std::cerr << "bench-kernel: S=" << s << " " << dtype_name << " " << mask << " " << row.pass << " repeat "
              << r + 1 << "/" << a.repeats << "\n";
    for (at::Tensor* t : {&q, &k, &v}) t->mutable_grad() = at::Tensor();
    MemoryScope scope;
    const double cpu_start = process_cpu_seconds();
    const auto start = std::chrono::steady_clock::now();
    at::Tensor out = blockwise_attention(q, k, v, scaling, st, opt);
    int64_t results = static_cast<int64_t>(out.nbytes());
    if (backward) {
      out.backward(dout);
      results += static_cast<int64_t>(q.grad().nbytes() + k.grad().nbytes() + v.grad().nbytes());
    }
    times_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    busy.push_back((process_cpu_seconds() - cpu_start) * 1e3 / (times_ms.back() * at::get_num_threads()));
    row.peak_extra_bytes = std::max(row.peak_extra_bytes, scope.peak_extra_bytes());
    row.temporaries_bytes = std::max(row.temporaries_bytes, scope.peak_extra_bytes() - results);
    if (!a.vs_torch) continue;
    // torch's SDPA right after, on the same operands: drift on this shared host hits both alike
    const at::Tensor ours = out.detach();
    out = at::Tensor();
    for (at::Tensor* t : {&q, &k, &v}) t->mutable_grad() = at::Tensor();
    MemoryScope torch_scope;
    const auto torch_start = std::chrono::steady_clock::now();
    at::Tensor theirs = torch_sdpa(q, k, v, scaling, causal);
    if (backward) theirs.backward(dout);
    torch_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - torch_start).count());
    row.torch_peak_extra_bytes = std::max(row.torch_peak_extra_bytes, torch_scope.peak_extra_bytes());
    const double scale = ours.abs().max().item<double>();
    row.torch_max_diff = (theirs.detach().to(at::kFloat) - ours.to(at::kFloat)).abs().max().item<double>() /
                         (scale > 0 ? scale : 1.0);
  }
  const double flops = forward_flops(a, s, causal) * (backward ? 1.0 + kBackwardFactor : 1.0);
  row.median_ms = median(times_ms);
  row.cpu_busy = median(busy);
  row.gflops = flops / (row.median_ms * 1e6);
  row.gemm_gflops = gemm_gflops;
  row.path = path_name(stats.path);
  row.tiles_computed = stats.forward_blocks_computed;
  row.tiles_total = stats.blocks_total;
  if (a.vs_torch) {
    row.torch_median_ms = median(torch_ms);
    row.torch_gflops = flops / (row.torch_median_ms * 1e6);
  }
  return row;
}

void warm_up(at::ScalarType dtype) {
  at::Tensor q = at::randn({1, 2, 256, 64}).to(dtype).requires_grad_(true);
  at::Tensor out = blockwise_attention(q, q, q, 0.125, structure_for(256, true));
  out.sum().backward();
}

nlohmann::json to_json(const Row& r) {
  nlohmann::json j = {{"seq", r.seq},
          {"dtype", r.dtype},
          {"mask", r.mask},
          {"layout", r.layout},
          {"pass", r.pass},
          {"path", r.path},
          {"median_ms", r.median_ms},
          {"gflops", r.gflops},
          {"gemm_gflops", r.gemm_gflops},
          {"ratio", r.gflops / r.gemm_gflops},
          {"peak_extra_bytes", r.peak_extra_bytes},
          {"temporaries_bytes", r.temporaries_bytes},
          {"tiles_computed", r.tiles_computed},
          {"tiles_total", r.tiles_total},
          {"cpu_busy", r.cpu_busy}};
  if (!r.torch_backend.empty()) {
    j["torch_backend"] = r.torch_backend;
    j["torch_median_ms"] = r.torch_median_ms;
    j["torch_gflops"] = r.torch_gflops;
    j["vs_torch"] = r.gflops / r.torch_gflops;
    j["torch_peak_extra_bytes"] = r.torch_peak_extra_bytes;
    j["torch_max_diff"] = r.torch_max_diff;
  }
  return j;
}

}  // namespace

CLI::App* add_kernel_bench_command(CLI::App& app, KernelBenchArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "bench-kernel", "blockwise attention GFLOP/s (forward, forward+backward) vs this machine's GEMM, peak memory");
  cmd->add_option("--seq", args.seq_lens, "sequence lengths S (comma-separated; 32768 fwd+bwd takes minutes)")
      ->delimiter(',')
      ->check(int_range(int64_t{1}, int64_t{1} << 22));
  cmd->add_option("--dtype", args.dtypes, "float32 | bfloat16 (comma-separated)")
      ->delimiter(',')
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  cmd->add_option("--mask", args.masks, "causal | full (comma-separated)")
      ->delimiter(',')
      ->check(CLI::IsMember({"causal", "full"}));
  cmd->add_option("--batch", args.batch, "batch B")->check(positive());
  cmd->add_option("--heads", args.heads, "heads H")->check(positive());
  cmd->add_option("--dqk", args.dqk, "query/key head dim")->check(positive());
  cmd->add_option("--dv", args.dv, "value head dim")->check(positive());
  cmd->add_option("--repeats", args.repeats, "timed calls per row (median reported)")->check(int_range(1, 1000));
  cmd->add_option("--gemm-size", args.gemm_size, "n of the n×n×n GEMM yardstick")->check(int_range(64, 8192));
  cmd->add_option("--block-q", args.block_q, "query rows per block (0: kernel default)")->check(int_range(0, 4096));
  cmd->add_option("--block-k", args.block_k, "key rows per block (0: kernel default)")->check(int_range(0, 4096));
  cmd->add_flag("--skip-backward", args.skip_backward, "time the forward only");
  std::vector<std::string> path_names;
  for (const auto& [name, path] : kPaths) path_names.push_back(name);
  cmd->add_option("--path", args.paths,
                  "kernel code paths (comma-separated; automatic = the kernel's choice; each runs for the dtypes "
                  "it computes)")
      ->delimiter(',')
      ->check(CLI::IsMember(path_names));
  cmd->add_option("--layout", args.layouts,
                  "memory layout of q, k, v: bhsd (head-major) | bshd (sequence-major, as the CP runtime passes "
                  "them) (comma-separated)")
      ->delimiter(',')
      ->check(CLI::IsMember({"bhsd", "bshd"}));
  cmd->add_option("--json", args.json_path, "also write the rows as JSON to FILE")->check(output_file());
  cmd->add_flag("--vs-torch", args.vs_torch,
                "also time torch's scaled_dot_product_attention on the same operands (V zero-padded to Dqk, as "
                "its CPU flash kernel needs; the backend it took is named), alternating with mlacp's kernel, and "
                "mlacp's ratio to it (LibTorch 2.x)");
  return cmd;
}

int run_kernel_bench(const CommonArgs& common, const KernelBenchArgs& args) {
  MLACP_REQUIRE(!args.vs_torch || torch_sdpa_available(), "bench-kernel --vs-torch",
                "torch's scaled_dot_product_attention exists from LibTorch 2.0 on", {got("LibTorch", "1.x")},
                "build against the PyTorch 2.x wheel's LibTorch (MLACP_LIBTORCH=wheel scripts/build.sh) or drop "
                "--vs-torch");
  for (const std::string& path : args.paths) {
    bool used = false;
    for (const std::string& dtype : args.dtypes) used = used || computes(path, dtype);
    std::string dtypes;
    for (const std::string& d : args.dtypes) dtypes += (dtypes.empty() ? "" : ",") + d;
    MLACP_REQUIRE(used, "bench-kernel --path", "each path must compute one of the --dtype values",
                  {got("--path", path), got("--dtype", dtypes)},
                  "bf16_* paths need --dtype bfloat16, float32_* paths --dtype float32");
    MLACP_REQUIRE(path_supported(path_of(path)), "bench-kernel --path",
                  "the path needs CPU features this machine lacks", {got("--path", path)},
                  "mlacp info lists the CPU's extensions; use automatic");
  }
  {
    // The largest row: q, k, v, out and their gradients (dO, dq, dk, dv), in float32 for the bf16
    // paths' widened copies too, plus the head-major K/V copy and its dK/dV.
    MemoryEstimate estimate;
    const int64_t longest = *std::max_element(args.seq_lens.begin(), args.seq_lens.end());
    const double rows = static_cast<double>(args.batch) * static_cast<double>(args.heads) * static_cast<double>(longest);
    const double width = 2.0 * static_cast<double>(args.dqk) + 2.0 * static_cast<double>(args.dv);
    estimate.add("inputs, output and gradients", rows * width * 4.0 * (args.skip_backward ? 1.0 : 2.0));
    estimate.add("kernel buffers", rows * width * 4.0);
    // torch's SDPA: V and dV padded to Dqk, its output and gradients, its own buffers
    if (args.vs_torch) estimate.add("torch SDPA", rows * 2.0 * width * 4.0);
    check_run_memory(common, "bench-kernel", estimate, 1);
  }
  apply_threads(common);
  install_memory_probe();
  const int threads = at::get_num_threads();
  const BlasInfo blas = loaded_blas();
  std::cerr << "bench-kernel: " << threads << " intra-op threads; measuring GEMM rates (n=" << args.gemm_size << ")\n";
  // The yardstick is re-measured right before each row (this host is shared: rates drift).
  nlohmann::json gemm_json = nlohmann::json::object();
  for (const std::string& name : args.dtypes) {
    const GemmRate rate = measure_gemm(dtype_of(name), args.gemm_size);
    gemm_json[name] = {{"n", rate.size}, {"median_ms", rate.median_ms}, {"gflops", rate.gflops}};
    warm_up(dtype_of(name));
  }
  std::vector<Row> rows;
  for (int64_t s : args.seq_lens)
    for (const std::string& dtype : args.dtypes)
      for (const std::string& mask : args.masks)
        for (const std::string& path : args.paths)
          for (const std::string& layout : args.layouts)
            for (bool backward : {false, true}) {
              if ((backward && args.skip_backward) || !computes(path, dtype)) continue;
              const double gemm_gflops = measure_gemm(dtype_of(dtype), args.gemm_size).gflops;
              rows.push_back(bench_case(args, s, dtype, mask, backward, gemm_gflops, path_of(path), layout));
            }

  std::cout << "blockwise attention, B=" << args.batch << " H=" << args.heads << " Dqk=" << args.dqk
            << " Dv=" << args.dv << ", " << threads << " threads, BLAS " << blas.library << "\n"
            << "useful FLOPs: " << kConvention << "\n"
            << "ratio = kernel GFLOP/s / GEMM GFLOP/s (" << args.gemm_size
            << "^3, same dtype and threads, measured just before the row); "
            << "temporaries = peak extra tensor bytes minus out (and dq, dk, dv); "
            << "cpu = process CPU time / (wall x threads) during the kernel (< 0.9: other processes took cores)\n";
  if (std::find(args.dtypes.begin(), args.dtypes.end(), "bfloat16") != args.dtypes.end())
    std::cout << "bf16 path (automatic): " << bf16_path_choice().reason << "\n";
  std::cout << "\n";
  Table table({"S", "dtype", "mask", "layout", "pass", "path", "median ms", "GFLOP/s", "GEMM GFLOP/s", "ratio",
               "peak extra MiB", "temporaries MiB", "tiles", "cpu"});
  nlohmann::json json_rows = nlohmann::json::array();
  for (const Row& r : rows) {
    table.add({std::to_string(r.seq), r.dtype, r.mask, r.layout, r.pass, r.path, fixed(r.median_ms, 1), fixed(r.gflops, 1),
               fixed(r.gemm_gflops, 1), fixed(r.gflops / r.gemm_gflops, 2), fixed(r.peak_extra_bytes / kMiB, 1),
               fixed(r.temporaries_bytes / kMiB, 1),
               std::to_string(r.tiles_computed) + "/" + std::to_string(r.tiles_total), fixed(r.cpu_busy, 2)});
    json_rows.push_back(to_json(r));
  }
  table.print(std::cout);
  if (args.vs_torch) {
    std::cout << "\ntorch's scaled_dot_product_attention on the same operands (V zero-padded to Dqk=" << args.dqk
              << " where Dv=" << args.dv << " differs, output sliced back; same useful FLOPs), each call right "
              << "after mlacp's; x torch = mlacp GFLOP/s / torch GFLOP/s; diff = max |out_torch - out_mlacp| / "
              << "max |out_mlacp|\n";
    Table vs({"S", "dtype", "mask", "layout", "pass", "torch backend", "torch median ms", "torch GFLOP/s",
              "mlacp GFLOP/s", "x torch", "torch peak extra MiB", "diff"});
    for (const Row& r : rows)
      vs.add({std::to_string(r.seq), r.dtype, r.mask, r.layout, r.pass, r.torch_backend, fixed(r.torch_median_ms, 1),
              fixed(r.torch_gflops, 1), fixed(r.gflops, 1), fixed(r.gflops / r.torch_gflops, 2),
              fixed(r.torch_peak_extra_bytes / kMiB, 1), sci(r.torch_max_diff)});
    vs.print(std::cout);
  }
  if (!args.json_path.empty()) {
    const nlohmann::json doc{
        {"command", "bench-kernel"},
        {"threads", threads},
        {"blas", blas.library},
        {"bf16_path_choice", bf16_path_choice().reason},
        {"shape", {{"batch", args.batch}, {"heads", args.heads}, {"dqk", args.dqk}, {"dv", args.dv}}},
        {"flop_convention", kConvention},
        {"repeats", args.repeats},
        {"gemm_at_start", gemm_json},
        {"rows", json_rows}};
    write_output_file("--json", args.json_path, doc.dump(2) + "\n");
  }
  // A ratio against a yardstick that computed something else would be meaningless: say so, fail.
  int disagreements = 0;
  for (const Row& r : rows)
    if (args.vs_torch && !(r.torch_max_diff <= torch_tolerance(dtype_of(r.dtype)))) {
      std::cerr << "bench-kernel: torch's SDPA and mlacp's kernel disagree at S=" << r.seq << " " << r.dtype << " "
                << r.mask << " " << r.pass << ": " << r.torch_max_diff << " > " << torch_tolerance(dtype_of(r.dtype))
                << "\n";
      ++disagreements;
    }
  return disagreements == 0 ? 0 : 1;
}

}  // namespace mlacp::tools
