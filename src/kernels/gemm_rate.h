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

// Which BLAS library this process loaded (from /proc/self/maps), and whether it is the slow
// reference netlib one.
struct BlasInfo {
  std::string library;  // resolved path, or "unknown"
  bool is_reference = false;
};
BlasInfo loaded_blas();

}  // namespace mlacp
