// Where LibTorch's float32 GEMMs run. Debian's LibTorch calls the system BLAS (`sgemm_` of
// libblas.so.3); Debian's OpenBLAS 0.3.21 does not recognise recent CPU models and runs its
// oldest x86-64 kernels there (measured on an AVX-512 Xeon: 29.8 GFLOP/s on one thread, against
// 135 for oneDNN's dnnl_sgemm, which LibTorch already loads, and 104 for OpenBLAS forced to its
// SkylakeX kernels). In such builds (MLACP_ROUTE_FLOAT32_GEMM, set by CMake when LibTorch imports
// sgemm_) libmlacp defines `sgemm_` itself: the first definition the dynamic linker finds, so
// LibTorch's calls reach it, and it forwards each call to oneDNN or to the BLAS, chosen once per
// process by choose_float32_gemm (docs/DESIGN.md §14).
#pragma once

#include <cstdint>
#include <string>

namespace mlacp {

enum class Float32GemmEngine { kBlas, kOneDnn };

// MLACP_FLOAT32_GEMM: "auto" (or unset), "blas" (always the BLAS), "onednn" (always oneDNN).
// Throws mlacp::Error for any other value (the tool checks it at start-up).
std::string float32_gemm_setting();

// The choice, pure (tested on its own): "blas"/"onednn" as asked (oneDNN only when it is loaded);
// "auto": oneDNN when it is loaded and the BLAS runs a fallback core for this CPU
// (openblas_core_is_fallback), else the BLAS.
Float32GemmEngine choose_float32_gemm(const std::string& setting, bool onednn_loaded, bool blas_core_is_fallback);

struct Float32GemmRoute {
  bool routed = false;  // this build defines sgemm_ (LibTorch's float32 GEMMs pass through mlacp)
  Float32GemmEngine engine = Float32GemmEngine::kBlas;
  std::string detail;   // one line for `mlacp info`: the engine and why
};
// This process's route (decided on first use, then fixed).
const Float32GemmRoute& float32_gemm_route();

// One column-major float32 GEMM (Fortran BLAS arguments) on the given engine; false when that
// engine is not loaded or refuses the arguments. What sgemm_ runs; tests call it per engine.
bool run_float32_gemm(Float32GemmEngine engine, char transa, char transb, int m, int n, int k, float alpha,
                      const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc);

// Calls of LibTorch's sgemm_ that mlacp's definition served, per engine since the process
// started (0 when the build does not route): proof that the route is in effect.
uint64_t routed_float32_gemm_calls(Float32GemmEngine engine);

}  // namespace mlacp
