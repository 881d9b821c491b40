// The float32 GEMM route (src/kernels/float32_gemm.h): the choice, each engine against a float64
// GEMM over every argument form LibTorch uses, and that LibTorch's own GEMMs pass through it.
#include "kernels/float32_gemm.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "mlacp/errors.h"

namespace mlacp {
namespace {

TEST(Float32Gemm, ChoiceFollowsTheSettingAndTheBlasCore) {
  using E = Float32GemmEngine;
  EXPECT_EQ(choose_float32_gemm("auto", true, true), E::kOneDnn);
  EXPECT_EQ(choose_float32_gemm("auto", true, false), E::kBlas);
  EXPECT_EQ(choose_float32_gemm("auto", false, true), E::kBlas);  // nothing better loaded
  EXPECT_EQ(choose_float32_gemm("blas", true, true), E::kBlas);
  EXPECT_EQ(choose_float32_gemm("onednn", true, false), E::kOneDnn);
  EXPECT_EQ(choose_float32_gemm("onednn", false, false), E::kBlas);
}

TEST(Float32Gemm, SettingIsValidated) {
  const char* saved = std::getenv("MLACP_FLOAT32_GEMM");
  const std::string keep = saved ? saved : "";
  setenv("MLACP_FLOAT32_GEMM", "mkl", 1);
  try {
    float32_gemm_setting();
    ADD_FAILURE() << "MLACP_FLOAT32_GEMM=mkl accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("auto"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("mkl"), std::string::npos) << e.what();
  }
  setenv("MLACP_FLOAT32_GEMM", "onednn", 1);
  EXPECT_EQ(float32_gemm_setting(), "onednn");
  if (saved) setenv("MLACP_FLOAT32_GEMM", keep.c_str(), 1);
  else unsetenv("MLACP_FLOAT32_GEMM");
  if (!saved) EXPECT_EQ(float32_gemm_setting(), "auto");
}

// C (m×n, column-major, ld ldc) = alpha·op(A)·op(B) + beta·C in float64.
void reference(char ta, char tb, int m, int n, int k, double alpha, const std::vector<float>& a, int lda,
               const std::vector<float>& b, int ldb, double beta, std::vector<double>& c, int ldc) {
  const bool trans_a = ta != 'N' && ta != 'n', trans_b = tb != 'N' && tb != 'n';
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      double s = 0;
      for (int p = 0; p < k; ++p) {
        const double x = trans_a ? a[p + static_cast<size_t>(i) * lda] : a[i + static_cast<size_t>(p) * lda];
        const double y = trans_b ? b[j + static_cast<size_t>(p) * ldb] : b[p + static_cast<size_t>(j) * ldb];
        s += x * y;
      }
      double& out = c[i + static_cast<size_t>(j) * ldc];
      out = alpha * s + (beta == 0 ? 0.0 : beta * out);
    }
}

TEST(Float32Gemm, EachLoadedEngineMatchesFloat64OnEveryArgumentForm) {
  struct Case {
    char ta, tb;
    int m, n, k, pad;
    float alpha, beta;
  };
  const std::vector<Case> cases = {
      {'N', 'N', 64, 48, 32, 0, 1.f, 0.f},  {'T', 'N', 33, 17, 65, 3, 1.f, 0.f}, {'N', 'T', 1, 70, 9, 1, 2.f, 0.5f},
      {'t', 'n', 70, 1, 1, 0, -1.f, 1.f},   {'C', 'T', 5, 7, 129, 2, 0.5f, 0.f}, {'n', 'c', 128, 96, 200, 5, 1.f, -2.f},
      {'N', 'N', 3, 3, 0, 0, 1.f, 0.5f},  {'T', 'T', 4, 2, 6, 0, 0.f, 0.f}};
  int ran_engines = 0;
  for (const Float32GemmEngine engine : {Float32GemmEngine::kBlas, Float32GemmEngine::kOneDnn}) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    bool available = true;
    for (const Case& t : cases) {
      const bool trans_a = t.ta != 'N' && t.ta != 'n', trans_b = t.tb != 'N' && t.tb != 'n';
      const int a_rows = trans_a ? t.k : t.m, a_cols = trans_a ? t.m : t.k;
      const int b_rows = trans_b ? t.n : t.k, b_cols = trans_b ? t.k : t.n;
      const int lda = std::max(1, a_rows + t.pad), ldb = std::max(1, b_rows + t.pad), ldc = t.m + t.pad;
      std::vector<float> a(static_cast<size_t>(lda) * std::max(1, a_cols)), b(static_cast<size_t>(ldb) * std::max(1, b_cols));
      for (auto& x : a) x = u(rng);
      for (auto& x : b) x = u(rng);
      std::vector<float> c(static_cast<size_t>(ldc) * t.n);
      // beta = 0: C is not read (NaN stays out of the result), as the BLAS defines it.
      for (auto& x : c) x = t.beta == 0.f ? std::numeric_limits<float>::quiet_NaN() : u(rng);
      std::vector<double> expect(c.begin(), c.end());
      reference(t.ta, t.tb, t.m, t.n, t.k, t.alpha, a, lda, b, ldb, t.beta, expect, ldc);
      if (!run_float32_gemm(engine, t.ta, t.tb, t.m, t.n, t.k, t.alpha, a.data(), lda, b.data(), ldb, t.beta, c.data(),
                            ldc)) {
        available = false;
        break;
      }
      for (int j = 0; j < t.n; ++j)
        for (int i = 0; i < t.m; ++i) {
          const size_t at = i + static_cast<size_t>(j) * ldc;
          ASSERT_NEAR(c[at], expect[at], 1e-4 * (1 + std::abs(expect[at])) * std::sqrt(t.k + 1.0))
              << "engine " << static_cast<int>(engine) << " " << t.ta << t.tb << " m=" << t.m << " n=" << t.n
              << " k=" << t.k << " at (" << i << "," << j << ")";
        }
    }
    ran_engines += available;
  }
  EXPECT_GE(ran_engines, 1);
  // Where the build routes, oneDNN is what LibTorch loads next to the BLAS: both must have run.
  if (float32_gemm_route().routed) EXPECT_EQ(ran_engines, 2);
}

TEST(Float32Gemm, LibTorchGemmsPassThroughTheRouteWhereTheBuildRoutes) {
  const Float32GemmRoute& route = float32_gemm_route();
  EXPECT_FALSE(route.detail.empty());
  const uint64_t before = routed_float32_gemm_calls(route.engine);
  const at::Tensor a = at::randn({96, 80}), b = at::randn({80, 64});
  const at::Tensor c = at::mm(a, b);
  EXPECT_TRUE(at::allclose(c, at::mm(a.to(at::kDouble), b.to(at::kDouble)).to(at::kFloat), 1e-4, 1e-4));
  const uint64_t after = routed_float32_gemm_calls(route.engine);
  if (route.routed) EXPECT_GT(after, before) << route.detail;
  else EXPECT_EQ(after, before);
}

}  // namespace
}  // namespace mlacp
