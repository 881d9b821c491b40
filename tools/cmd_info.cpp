// `mlacp info`: what this machine gives mlacp (LibTorch, BLAS, threads, the attention kernel's
// paths, Gloo, GEMM rates).
#include <iostream>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include "commands.h"
#include "option_checks.h"
#include "comm/gloo_probe.h"
#include "core/device.h"
#include "kernels/blockwise_attention.h"
#include "kernels/float32_gemm.h"
#include "kernels/gemm_rate.h"
#include "mlacp/config.h"
#include "table.h"

namespace mlacp::tools {

CLI::App* add_info_command(CLI::App& app, InfoArgs& args) {
  CLI::App* cmd = app.add_subcommand("info", "LibTorch version, BLAS, threads, Gloo, measured GEMM GFLOP/s");
  cmd->add_option("--gemm-size", args.gemm_size, "n of the n×n×n GEMM timed per dtype")->check(int_range(64, 8192));
  cmd->add_flag("--skip-gemm", args.skip_gemm, "do not time GEMMs");
  return cmd;
}

int run_info(const CommonArgs& common, const InfoArgs& args) {
  apply_threads(common);
  std::cout << "mlacp        0.1.0\n";
  std::cout << "LibTorch     " << TORCH_VERSION << "\n";
  std::cout << "threads      " << at::get_num_threads() << " intra-op (set with --threads)\n";
  std::cout << "allocator    " << host_allocator_policy().detail
            << (host_allocator_policy().applied ? " (MLACP_HOST_ALLOCATOR=system keeps glibc's defaults)" : "") << "\n";
  const BlasInfo blas = loaded_blas();
  const Float32GemmRoute& route = float32_gemm_route();
  const bool routed_away = route.routed && route.engine == Float32GemmEngine::kOneDnn;
  std::cout << "BLAS         " << blas.library
            << (blas.is_reference ? "  [reference netlib BLAS: float32 GEMM is slow; apt-get install libopenblas0-pthread]"
                                  : "")
            << "\n";
  std::cout << "BLAS core    " << (blas.core.empty() ? "(not reported by the library)" : blas.core) << " on a CPU with "
            << blas.cpu
            << (blas.core_is_fallback ? routed_away ? "  [fallback core: LibTorch's float32 GEMMs do not use it, next line]"
                                                    : "  [FALLBACK: see the warning after the GEMM rates]"
                                      : "")
            << "\n";
  std::cout << "float32 GEMM " << route.detail << "\n";
  // The attention kernel's paths, chosen at run time from the CPU (docs/DESIGN.md §10, §14).
  std::cout << "attention    float32 " << path_name(automatic_path(at::kFloat)) << "; bfloat16 "
            << bf16_path_choice().reason << "\n";
  const GlooProbe gloo = probe_gloo();
  std::cout << "c10d Gloo    " << (gloo.available ? "available" : "NOT available") << " (" << gloo.detail << ")\n";
#ifdef USE_C10D_NCCL
  const char* nccl = "built in";
#else
  const char* nccl = "not in this LibTorch";
#endif
  std::cout << "CUDA         " << device_count(c10::DeviceType::CUDA) << " visible GPU(s); c10d NCCL " << nccl
            << " (--device cuda: docs/DESIGN.md §16; run on one GPU, NCCL between GPUs not yet)\n";
  std::cout << "presets      ";
  for (const auto& name : preset_names()) std::cout << name << " ";
  std::cout << "\n";
  if (args.skip_gemm) {
    if (blas.core_is_fallback && !routed_away) std::cout << "warning: " << blas.core_detail << "; float32 GEMMs run far below this CPU's rate\n";
    return 0;
  }
  std::cout << "\n";
  Table table({"GEMM", "n", "median ms", "GFLOP/s"});
  double float32_gflops = 0.0;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const GemmRate rate = measure_gemm(dtype, args.gemm_size);
    if (dtype == at::kFloat) float32_gflops = rate.gflops;
    table.add({dtype == at::kFloat ? "float32" : "bfloat16", std::to_string(rate.size), fixed(rate.median_ms, 2),
               fixed(rate.gflops, 1)});
  }
  table.print(std::cout);
  if (blas.core_is_fallback && !routed_away) {
    std::cout << "\nwarning: " << blas.core_detail << ": float32 GEMM measured " << fixed(float32_gflops, 1)
              << " GFLOP/s on " << at::get_num_threads() << " thread(s), far below this CPU's rate; the projections of\n"
              << "  every float32 step run at it.\n"
              << "  Way out: " << (route.routed ? "unset MLACP_FLOAT32_GEMM (oneDNN then runs them), " : "")
              << "a BLAS that recognises this CPU (e.g. a newer OpenBLAS), or OpenBLAS's own override\n"
              << "  OPENBLAS_CORETYPE=" << (blas.cpu == "AVX-512" ? "SkylakeX" : "Haswell")
              << " (check its results first: some processors set it because older builds compute wrong results there).\n";
  }
  return 0;
}

}  // namespace mlacp::tools
