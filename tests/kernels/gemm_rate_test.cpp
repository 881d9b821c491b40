#include <gtest/gtest.h>

#include "kernels/gemm_rate.h"

namespace mlacp {
namespace {

TEST(BlasCore, OlderCoresAreFallbacksOnNewerCpus) {
  // Debian's OpenBLAS 0.3.21 on an Intel family 6 model 207 (AVX-512): Prescott kernels.
  EXPECT_TRUE(openblas_core_is_fallback("Prescott", true, true));
  EXPECT_TRUE(openblas_core_is_fallback("Sandybridge", true, false));
  EXPECT_TRUE(openblas_core_is_fallback("Haswell", true, true));   // AVX2 kernels on an AVX-512 CPU
  EXPECT_TRUE(openblas_core_is_fallback("zen", true, true));       // names are case-insensitive
}

TEST(BlasCore, MatchingCoresAndUnknownNamesAreNot) {
  EXPECT_FALSE(openblas_core_is_fallback("SkylakeX", true, true));
  EXPECT_FALSE(openblas_core_is_fallback("Cooperlake", true, true));
  EXPECT_FALSE(openblas_core_is_fallback("Haswell", true, false));
  EXPECT_FALSE(openblas_core_is_fallback("Zen", true, false));
  EXPECT_FALSE(openblas_core_is_fallback("Prescott", false, false));  // an SSE-only CPU
  EXPECT_FALSE(openblas_core_is_fallback("SomeFutureCore", true, true));
  EXPECT_FALSE(openblas_core_is_fallback("", true, true));
}

TEST(BlasCore, LoadedBlasNamesTheCpuAndIsConsistent) {
  const BlasInfo info = loaded_blas();
  EXPECT_NE(info.library, "");
  EXPECT_TRUE(info.cpu == "AVX-512" || info.cpu == "AVX2" || info.cpu == "SSE") << info.cpu;
  if (info.core_is_fallback) EXPECT_NE(info.core_detail.find(info.core), std::string::npos);
  if (info.core.empty()) EXPECT_FALSE(info.core_is_fallback);
}

}  // namespace
}  // namespace mlacp
