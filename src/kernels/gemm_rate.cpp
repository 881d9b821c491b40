#include "kernels/gemm_rate.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Version.h>

namespace mlacp {

GemmRate measure_gemm(c10::ScalarType dtype, int64_t size, int repeats) {
  const auto options = at::TensorOptions().dtype(dtype);
  at::Tensor a = at::randn({size, size}, options);
  at::Tensor b = at::randn({size, size}, options);
  at::Tensor c = at::empty({size, size}, options);
  at::mm_out(c, a, b);  // warm-up (and first-touch of c)
  std::vector<double> times_ms;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    at::mm_out(c, a, b);
    times_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times_ms.begin(), times_ms.end());
  GemmRate rate;
  rate.size = size;
  rate.median_ms = times_ms[times_ms.size() / 2];
  rate.gflops = 2.0 * size * size * static_cast<double>(size) / (rate.median_ms * 1e6);
  return rate;
}

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// LibTorch's own record of its BLAS (BLAS_INFO=... in at::show_config()): the PyTorch wheel links
// MKL statically, so no BLAS file appears in /proc/self/maps.
std::string configured_blas() {
  const std::string config = at::show_config();
  const auto at = config.find("BLAS_INFO=");
  if (at == std::string::npos) return "";
  const auto end = config.find_first_of(", \n", at);
  return config.substr(at + 10, end == std::string::npos ? std::string::npos : end - at - 10);
}

}  // namespace

bool openblas_core_is_fallback(const std::string& core, bool cpu_avx2, bool cpu_avx512) {
  // OpenBLAS's x86-64 DYNAMIC_ARCH core names (driver/others/dynamic.c), by the widest vector
  // extension their kernels use.
  static const char* const kAvx512[] = {"skylakex", "cooperlake", "sapphirerapids"};
  static const char* const kAvx2[] = {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"};
  static const char* const kOlder[] = {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom",
                                       "sandybridge", "barcelona", "bulldozer", "piledriver", "steamroller",
                                       "excavator", "bobcat", "opteron", "opteron_sse3", "katmai", "coppermine",
                                       "northwood", "banias", "athlon", "nano"};
  const std::string c = lower(core);
  auto in = [&](const auto& list) { return std::find(std::begin(list), std::end(list), c) != std::end(list); };
  const bool known = in(kAvx2) || in(kOlder);
  if (!known) return false;
  if (cpu_avx512 && !in(kAvx512)) return true;
  return cpu_avx2 && !in(kAvx2);
}

BlasInfo loaded_blas() {
  BlasInfo info{"unknown", false};
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = std::filesystem::path(path).filename().string();
    if (file.find("blas") == std::string::npos) continue;
    if (file.find("cublas") != std::string::npos || file.find("hipblas") != std::string::npos) continue;  // GPU BLAS
    std::error_code ec;
    const std::string resolved = std::filesystem::canonical(path, ec).string();
    info.library = ec ? path : resolved;
    info.is_reference = info.library.find("openblas") == std::string::npos &&
                        info.library.find("mkl") == std::string::npos &&
                        info.library.find("blis") == std::string::npos;
    if (!info.is_reference) break;  // prefer an optimised one if several are mapped
  }
  if (info.library == "unknown") {
    const std::string configured = configured_blas();
    if (!configured.empty()) info.library = configured + " (linked into LibTorch)";
  }
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f");
  info.cpu = avx512 ? "AVX-512" : avx2 ? "AVX2" : "SSE";
  using CoreName = char* (*)();
  if (auto corename = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    if (const char* name = corename()) info.core = name;
    info.core_is_fallback = openblas_core_is_fallback(info.core, avx2, avx512);
    if (info.core_is_fallback) {
      info.core_detail = "OpenBLAS runs its " + info.core + " kernels on a CPU with " + info.cpu +
                         " (it did not recognise this CPU model and fell back)";
    }
  }
  return info;
}

}  // namespace mlacp
