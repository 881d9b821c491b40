// Measures this machine's GEMM rate, the yardstick for every kernel GFLOP/s number we report.
#pragma once

#include <string>

#include <c10/core/ScalarType.h>

namespace mlacp {

struct GemmRate {
  int64_t size = 0;          // n for an n×n×n GEMM
  double median_ms = 0.0;
  double gflops = 0.0;       // 2n³ / median time
};

// Median over `repeats` timed runs after one warm-up, on the current intra-op thread count.
GemmRate measure_gemm(c10::ScalarType dtype, int64_t size, int repeats = 5);

// Which BLAS library this process loaded (from /proc/self/maps, else LibTorch's build config),
// whether it is the slow reference netlib one, and which kernel core it runs: OpenBLAS's own name
// (openblas_get_corename) with a verdict on whether it is a fallback for this CPU.
struct BlasInfo {
  std::string library;  // resolved path, or "unknown"
  bool is_reference = false;
  std::string core;         // e.g. "SkylakeX", "Prescott"; empty when the library does not say
  std::string cpu;          // the CPU's vector extensions that matter here, e.g. "AVX-512"
  bool core_is_fallback = false;
  std::string core_detail;  // why it is a fallback, for the warning
};
BlasInfo loaded_blas();

// Whether an OpenBLAS kernel core is a fallback on a CPU with these extensions: a core without
// AVX2 on an AVX2 CPU, or without AVX-512 on an AVX-512 CPU (OpenBLAS picks such cores when it does
// not recognise the CPU model). Unknown names are not judged. Pure: tested on its own.
bool openblas_core_is_fallback(const std::string& core, bool cpu_avx2, bool cpu_avx512);

}  // namespace mlacp
