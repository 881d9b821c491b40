#include "kernels/float32_gemm.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "core/threads.h"
#include "kernels/gemm_rate.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

// Fortran BLAS (column-major; LibTorch passes no hidden string lengths) and oneDNN (row-major).
using BlasSgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                           const int*, const float*, const int*, const float*, float*, const int*);
using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
using OmpGetThreads = int (*)();
using OmpSetThreads = void (*)(int);

struct Engines {
  BlasSgemm blas = nullptr;   // the next sgemm_ after ours (the system BLAS)
  DnnlSgemm onednn = nullptr;
  OmpGetThreads omp_get = nullptr;
  OmpSetThreads omp_set = nullptr;
  Float32GemmRoute route;
};

const char* blas_core_name() {
  using CoreName = char* (*)();
  auto corename = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = corename ? corename() : nullptr;
  return name ? name : "";
}

const Engines& engines() {
  static const Engines e = [] {
    Engines x;
#if MLACP_ROUTE_FLOAT32_GEMM
    x.blas = reinterpret_cast<BlasSgemm>(dlsym(RTLD_NEXT, "sgemm_"));
    x.route.routed = true;
#else
    x.blas = reinterpret_cast<BlasSgemm>(dlsym(RTLD_DEFAULT, "sgemm_"));
#endif
    x.onednn = reinterpret_cast<DnnlSgemm>(dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
    x.omp_get = reinterpret_cast<OmpGetThreads>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
    x.omp_set = reinterpret_cast<OmpSetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
    std::string setting = "auto";
    try {
      setting = float32_gemm_setting();
    } catch (const Error&) {  // rejected by the tool at start-up; a library user gets "auto"
    }
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = __builtin_cpu_supports("avx512f");
    const std::string core = blas_core_name();
    const bool fallback = openblas_core_is_fallback(core, avx2, avx512);
    x.route.engine = choose_float32_gemm(setting, x.onednn != nullptr, fallback);
    if (!x.blas && x.onednn) x.route.engine = Float32GemmEngine::kOneDnn;  // nothing else to call
    if (!x.route.routed) {
      x.route.detail = "LibTorch's BLAS (this build does not route LibTorch's sgemm_)";
    } else if (x.route.engine == Float32GemmEngine::kOneDnn) {
      x.route.detail = "oneDNN dnnl_sgemm, via mlacp's sgemm_ (" +
                       (setting == "onednn" ? std::string("MLACP_FLOAT32_GEMM=onednn")
                                            : "the BLAS runs its fallback " + core + " kernels on this CPU") +
                       "; MLACP_FLOAT32_GEMM=blas keeps the BLAS)";
    } else {
      x.route.detail = "the BLAS, via mlacp's sgemm_ (" +
                       (setting == "blas"   ? std::string("MLACP_FLOAT32_GEMM=blas")
                        : !x.onednn         ? std::string("oneDNN is not loaded")
                        : core.empty()      ? std::string("the BLAS does not name its core")
                                            : "its " + core + " kernels suit this CPU") +
                       ")";
    }
    return x;
  }();
  return e;
}

std::atomic<uint64_t> g_routed_calls[2];

char row_major_trans(char t) { return (t == 'N' || t == 'n') ? 'N' : 'T'; }  // 'C' is 'T' for real data

}  // namespace

std::string float32_gemm_setting() {
  const char* value = std::getenv("MLACP_FLOAT32_GEMM");
  const std::string s = value ? value : "auto";
  MLACP_REQUIRE(s == "auto" || s == "blas" || s == "onednn", "MLACP_FLOAT32_GEMM",
                "must be auto (oneDNN when the BLAS runs a fallback core for this CPU), blas or onednn",
                {got("MLACP_FLOAT32_GEMM", s)}, "unset it for auto");
  return s;
}

Float32GemmEngine choose_float32_gemm(const std::string& setting, bool onednn_loaded, bool blas_core_is_fallback) {
  if (!onednn_loaded || setting == "blas") return Float32GemmEngine::kBlas;
  if (setting == "onednn") return Float32GemmEngine::kOneDnn;
  return blas_core_is_fallback ? Float32GemmEngine::kOneDnn : Float32GemmEngine::kBlas;
}

const Float32GemmRoute& float32_gemm_route() { return engines().route; }

uint64_t routed_float32_gemm_calls(Float32GemmEngine engine) {
  return g_routed_calls[static_cast<int>(engine)].load(std::memory_order_relaxed);
}

void count_routed_float32_gemm(Float32GemmEngine engine) {
  g_routed_calls[static_cast<int>(engine)].fetch_add(1, std::memory_order_relaxed);
}

bool run_float32_gemm(Float32GemmEngine engine, char transa, char transb, int m, int n, int k, float alpha,
                      const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  const Engines& e = engines();
  if (engine == Float32GemmEngine::kOneDnn) {
    if (!e.onednn) return false;
    if (m <= 0 || n <= 0) return m >= 0 && n >= 0;
    if (k == 0 || alpha == 0.f) {  // C = beta·C (oneDNN leaves C untouched when K = 0: measured)
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
          float& x = c[i + static_cast<int64_t>(j) * ldc];
          x = beta == 0.f ? 0.f : beta * x;
        }
      return k >= 0;
    }
    // oneDNN runs on OpenMP's pool: give this thread the process's intra-op count (a thread
    // LibTorch never configured would otherwise use every core, beside the other local ranks).
    if (const int want = intra_op_threads(); want > 0 && e.omp_get && e.omp_set && e.omp_get() != want)
      e.omp_set(want);
    // Column-major C = op(A)·op(B) is row-major Cᵀ = op(B)ᵀ·op(A)ᵀ over the same memory.
    return e.onednn(row_major_trans(transb), row_major_trans(transa), n, m, k, alpha, b, ldb, a, lda, beta, c, ldc) ==
           0;
  }
  if (!e.blas) return false;
  e.blas(&transa, &transb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
  return true;
}

}  // namespace mlacp

#if MLACP_ROUTE_FLOAT32_GEMM
namespace mlacp {
void count_routed_float32_gemm(Float32GemmEngine engine);
}
// LibTorch's float32 GEMMs: the engine of float32_gemm_route(); the BLAS when oneDNN refuses a
// call (it validates its arguments; the BLAS then reports them as it always did).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) {
  using mlacp::Float32GemmEngine;
  const Float32GemmEngine engine = mlacp::float32_gemm_route().engine;
  if (engine == Float32GemmEngine::kOneDnn &&
      mlacp::run_float32_gemm(engine, *transa, *transb, *m, *n, *k, *alpha, a, *lda, b, *ldb, *beta, c, *ldc)) {
    mlacp::count_routed_float32_gemm(engine);
    return;
  }
  mlacp::count_routed_float32_gemm(Float32GemmEngine::kBlas);
  if (!mlacp::run_float32_gemm(Float32GemmEngine::kBlas, *transa, *transb, *m, *n, *k, *alpha, a, *lda, b, *ldb,
                               *beta, c, *ldc)) {
    std::fputs("mlacp: float32 GEMM: no BLAS sgemm_ behind mlacp's in this process\n", stderr);
    std::abort();
  }
}
#endif
