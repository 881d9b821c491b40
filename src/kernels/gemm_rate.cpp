#include "kernels/gemm_rate.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <vector>

#include <ATen/ATen.h>

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
    std::error_code ec;
    const std::string resolved = std::filesystem::canonical(path, ec).string();
    info.library = ec ? path : resolved;
    info.is_reference = info.library.find("openblas") == std::string::npos &&
                        info.library.find("mkl") == std::string::npos &&
                        info.library.find("blis") == std::string::npos;
    if (!info.is_reference) break;  // prefer an optimised one if several are mapped
  }
  return info;
}

}  // namespace mlacp
