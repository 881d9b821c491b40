// The AMX GEMM of the bf16 path (gemm<Bf16Amx>) against a float64 sum of the same bf16 operands,
// for every way the kernel hands it A (pair-contiguous rows read in place or copied, strided,
// pair-transposed as P and dS are), partial rows, columns and K chunks, and `accumulate`.
// Skipped where this process has no AMX (cpu_has_amx_bf16). The float32 GEMMs of the AVX2 and
// AVX-512 paths against float64 sums of the same operands, every strip and edge width.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/blockwise_gemm.h"

namespace mlacp::blockwise_detail {
namespace {

enum class ALayout { rows, strided, pair_transposed };

struct Result {
  std::vector<float> c;
  double worst = 0;  // max |c − reference| / (Σ|a·b| + |c0| + tiny)
};

Result run(int64_t m, int64_t n, int64_t k, ALayout layout, bool accumulate, int64_t n_store, uint32_t seed) {
  using E = c10::BFloat16;
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  const int64_t k2 = round_up(k, 2), ku = k2 / 2;
  std::vector<float> a(m * k2, 0.0f), b(k * n);  // the bf16 values, as float
  for (int64_t r = 0; r < m; ++r)
    for (int64_t p = 0; p < k; ++p) a[r * k2 + p] = static_cast<float>(E(dist(gen)));
  for (float& x : b) x = static_cast<float>(E(dist(gen)));
  // A as the kernel passes it: pair (r, p) at a_buf + r·rs + p·cs.
  std::vector<E> a_buf;
  int64_t rs = 0, cs = 0;
  if (layout == ALayout::pair_transposed) {
    const int64_t ldm = round_up(m, kLanes);
    a_buf.assign(ku * ldm * 2, E(0.0f));
    rs = 2, cs = 2 * ldm;
  } else {
    cs = layout == ALayout::rows ? 2 : 6;  // strided: each pair followed by 4 unused elements
    rs = cs * ku + (layout == ALayout::rows ? 0 : 2);
    a_buf.assign(m * rs, E(0.0f));
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t p = 0; p < ku; ++p)
      for (int64_t h = 0; h < 2; ++h) a_buf[r * rs + p * cs + h] = E(a[r * k2 + 2 * p + h]);
  std::vector<E> b_rows(k * n), panels(panel_elems(k, n));
  for (int64_t i = 0; i < k * n; ++i) b_rows[i] = E(b[i]);
  pack_b_rows<Bf16Amx>({b_rows.data(), n}, k, n, panels.data());
  const int64_t ldc = round_up(n, kLanes) + 3;
  Result out;
  out.c.assign(m * ldc, 0.0f);
  for (float& x : out.c) x = accumulate ? dist(gen) : 12345.0f;  // sentinel where nothing is written
  const std::vector<float> c0 = out.c;
  gemm<Bf16Amx>(m, n, k, a_buf.data(), rs, cs, panels.data(), out.c.data(), ldc, accumulate, n_store);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < ldc; ++j) {
      const float got = out.c[r * ldc + j];
      if (j >= std::max(n, n_store)) {
        EXPECT_EQ(got, c0[r * ldc + j]) << "column " << j << " past n_store was written";
        continue;
      }
      if (j >= n) {
        EXPECT_EQ(got, accumulate ? c0[r * ldc + j] : 0.0f) << "padding column " << j;
        continue;
      }
      double want = accumulate ? c0[r * ldc + j] : 0.0, size = std::abs(want) + 1e-30;
      for (int64_t p = 0; p < k; ++p) {
        const double ab = static_cast<double>(a[r * k2 + p]) * b[p * n + j];
        want += ab, size += std::abs(ab);
      }
      out.worst = std::max(out.worst, std::abs(got - want) / size);
    }
  return out;
}

TEST(BlockwiseGemmAmx, EqualsTheFloat64SumOfTheSameBf16OperandsForEveryOperandLayout) {
  if (!cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 in this process (CPUID or Linux's tile permission)";
  struct Shape {
    int64_t m, n, k;
  };
  // Whole tiles and chunks (A read in place), partial rows, odd and partial K, partial and several
  // panels, a single pair.
  for (const Shape s : {Shape{32, 64, 192}, Shape{16, 128, 128}, Shape{37, 130, 192}, Shape{5, 20, 33},
                        Shape{48, 64, 7}, Shape{17, 1, 2}, Shape{128, 128, 128}})
    for (ALayout layout : {ALayout::rows, ALayout::strided, ALayout::pair_transposed})
      for (bool accumulate : {false, true}) {
        const int64_t n_store = round_up(s.n, kLanes);
        const Result r = run(s.m, s.n, s.k, layout, accumulate, n_store, 7);
        const std::string what = "m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" +
                                 std::to_string(s.k) + " layout " + std::to_string(static_cast<int>(layout)) +
                                 (accumulate ? " accumulate" : "");
        // float32 sums of exact products: K·2⁻²⁴ of Σ|a·b| at most.
        EXPECT_LE(r.worst, static_cast<double>(s.k + 2) * std::ldexp(1.0, -24)) << what;
        // Every layout reads the same pairs in the same chunk order: the same bits.
        if (layout != ALayout::rows) EXPECT_EQ(r.c, run(s.m, s.n, s.k, ALayout::rows, accumulate, n_store, 7).c) << what;
      }
}

TEST(BlockwiseGemmAmx, WritesPaddingColumnsUpToNStoreOnly) {
  if (!cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 in this process";
  run(16, 20, 64, ALayout::rows, false, 20, 3);  // n_store = n: columns 20.. keep the sentinel
  run(16, 20, 64, ALayout::rows, false, 32, 3);  // n_store = 32: columns 20..31 are zeros
  run(40, 70, 64, ALayout::pair_transposed, false, 72, 5);
}

// gemm<P> for a float32 path: C (=|+=) A · B with A at a + r·rs + p·cs (rows or transposed, as
// the kernel passes Q/K rows and P/dS tiles); returns max |c − reference| / (Σ|a·b| + |c0|).
template <class P>
double float32_gemm_error(int64_t m, int64_t n, int64_t k, bool transposed_a, bool accumulate, int64_t n_store,
                          uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  const int64_t ldm = round_up(m, kLanes) + (transposed_a ? 0 : 5);
  std::vector<float> a_buf(transposed_a ? k * ldm : m * (k + 3), 0.0f), b(k * n);
  const int64_t rs = transposed_a ? 1 : k + 3, cs = transposed_a ? ldm : 1;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t p = 0; p < k; ++p) a_buf[r * rs + p * cs] = dist(gen);
  for (float& x : b) x = dist(gen);
  std::vector<float> panels(panel_elems(k, n));
  pack_b_rows<P>({b.data(), n}, k, n, panels.data());
  const int64_t ldc = round_up(n, kLanes) + 3;
  std::vector<float> c(m * ldc);
  for (float& x : c) x = accumulate ? dist(gen) : 12345.0f;
  const std::vector<float> c0 = c;
  gemm<P>(m, n, k, a_buf.data(), rs, cs, panels.data(), c.data(), ldc, accumulate, n_store);
  double worst = 0;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < ldc; ++j) {
      const float got = c[r * ldc + j];
      if (j >= std::max(n, n_store)) {
        EXPECT_EQ(got, c0[r * ldc + j]) << "column " << j << " past n_store was written";
      } else if (j >= n) {
        EXPECT_EQ(got, accumulate ? c0[r * ldc + j] : 0.0f) << "padding column " << j;
      } else {
        double want = accumulate ? c0[r * ldc + j] : 0.0, size = std::abs(want) + 1e-30;
        for (int64_t p = 0; p < k; ++p) {
          const double ab = static_cast<double>(a_buf[r * rs + p * cs]) * b[p * n + j];
          want += ab, size += std::abs(ab);
        }
        worst = std::max(worst, std::abs(got - want) / size);
      }
    }
  return worst;
}

template <class P>
void expect_float32_gemm_exact_to_rounding(const char* path) {
  struct Shape {
    int64_t m, n, k;
  };
  // Whole and partial micro-tiles (4 rows on AVX-512, 6 on AVX2), strips and their 8-column tails,
  // several panels, K of 1 and odd K.
  for (const Shape s : {Shape{4, 64, 192}, Shape{37, 130, 192}, Shape{5, 20, 33}, Shape{3, 1, 1}, Shape{9, 24, 7},
                        Shape{8, 40, 128}, Shape{128, 128, 128}})
    for (bool transposed : {false, true})
      for (bool accumulate : {false, true})
        for (int64_t n_store : {s.n, round_up(s.n, kLanes)}) {
          const double worst = float32_gemm_error<P>(s.m, s.n, s.k, transposed, accumulate, n_store, 11);
          EXPECT_LE(worst, static_cast<double>(s.k + 2) * std::ldexp(1.0, -24))
              << path << " m=" << s.m << " n=" << s.n << " k=" << s.k << (transposed ? " A transposed" : "")
              << (accumulate ? " accumulate" : "") << " n_store=" << n_store;
        }
}

TEST(BlockwiseGemmFloat32, Avx2EqualsTheFloat64SumToRoundingForEveryStripAndEdge) {
  if (!cpu_has_avx2_fma()) GTEST_SKIP() << "no AVX2 + FMA on this CPU";
  expect_float32_gemm_exact_to_rounding<F32Avx2>("float32_avx2");
}

TEST(BlockwiseGemmFloat32, Avx512EqualsTheFloat64SumToRoundingForEveryStripAndEdge) {
  if (!cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  expect_float32_gemm_exact_to_rounding<F32Avx512>("float32_avx512");
}

}  // namespace
}  // namespace mlacp::blockwise_detail
