// Blockwise attention GEMM: micro-kernels (portable, AVX2 float32, AVX-512 float32, AVX-512-BF16, AMX-BF16), the gemm<P>
// driver that tiles C over them (instantiated per path), and the AVX-512 row helpers.
#include "kernels/blockwise_gemm.h"

#include <array>
#include <chrono>
#include <utility>
#include <vector>

#if MLACP_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mlacp::blockwise_detail {

#if MLACP_X86
MLACP_AVX512BF16 void f32_to_bf16_avx512(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

MLACP_AVX512 void bf16_to_f32_avx512(const c10::BFloat16* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

MLACP_AVX2 void bf16_to_f32_avx2(const c10::BFloat16* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[2n + h] = row_h[n] for n < w (row1 may be null: zeros; columns ≥ valid: zeros).
MLACP_AVX512BF16 void interleave_rows_bf16(const c10::BFloat16* row0, const c10::BFloat16* row1, int64_t valid,
                                           int64_t w, c10::BFloat16* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave16);
  for (int64_t n = 0; n < w; n += 16) {
    const int64_t take = std::max<int64_t>(0, std::min<int64_t>(16, valid - n));
    const __mmask16 m = static_cast<__mmask16>((1u << take) - 1);
    const __m256i a = _mm256_maskz_loadu_epi16(m, row0 + n);
    const __m256i b = row1 ? _mm256_maskz_loadu_epi16(m, row1 + n) : _mm256_setzero_si256();
    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    _mm512_storeu_si512(dst + 2 * n, _mm512_permutexvar_epi16(idx, ab));
  }
}
#endif

namespace {

// Micro-kernels: C[mr × cols] (=|+=) Σ_p A(r, p) · B[p][0..w), cols = (nv−1)·16 + last.
// A(r, p) at A[r*rs + p*cs] (pair paths: the pair starting there).
template <class T>
__attribute__((always_inline)) inline void ukernel_portable_body(int64_t mr, int64_t w, int64_t cols, int64_t k,
                                                                 const T* a, int64_t rs, int64_t cs, const T* b, T* c,
                                                                 int64_t ldc, bool accumulate) {
  T t[kMR][kNR] = {};
  for (int64_t p = 0; p < k; ++p) {
    const T* bp = b + p * w;
    for (int64_t r = 0; r < mr; ++r) {
      const T ar = a[r * rs + p * cs];
      for (int64_t n = 0; n < w; ++n) t[r][n] += ar * bp[n];
    }
  }
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t n = 0; n < cols; ++n) c[r * ldc + n] = accumulate ? c[r * ldc + n] + t[r][n] : t[r][n];
}

MLACP_CLONES void ukernel_portable(int64_t mr, int64_t w, int64_t cols, int64_t k, const float* a, int64_t rs,
                                   int64_t cs, const float* b, float* c, int64_t ldc, bool accumulate) {
  ukernel_portable_body<float>(mr, w, cols, k, a, rs, cs, b, c, ldc, accumulate);
}
MLACP_CLONES void ukernel_portable(int64_t mr, int64_t w, int64_t cols, int64_t k, const double* a, int64_t rs,
                                   int64_t cs, const double* b, double* c, int64_t ldc, bool accumulate) {
  ukernel_portable_body<double>(mr, w, cols, k, a, rs, cs, b, c, ldc, accumulate);
}

#if MLACP_X86
template <int MR, int NV>
MLACP_AVX512 void ukernel_f32(int64_t k, const float* a, int64_t rs, int64_t cs, const float* b, int64_t ldb, float* c,
                              int64_t ldc, int last, bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + p * ldb + v * 16);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r * rs + p * cs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
  const __mmask16 last_mask = static_cast<__mmask16>((1u << last) - 1);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xFFFF);
      float* cp = c + r * ldc + v * 16;
      __m512 x = acc[r][v];
      if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, cp));
      _mm512_mask_storeu_ps(cp, m, x);
    }
}

inline uint32_t load_pair(const c10::BFloat16* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

template <int MR, int NV>
MLACP_AVX512BF16 void ukernel_bf16(int64_t k2, const c10::BFloat16* a, int64_t rs, int64_t cs, const c10::BFloat16* b,
                                   int64_t ldb, float* c, int64_t ldc, int last, bool accumulate) {
  __m512 acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k2; ++p) {
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + p * ldb + v * 32);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i ar = _mm512_set1_epi32(static_cast<int>(load_pair(a + r * rs + p * cs)));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<const __m512bh&>(ar),
                                     reinterpret_cast<const __m512bh&>(bv[v]));
    }
  }
  const __mmask16 last_mask = static_cast<__mmask16>((1u << last) - 1);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xFFFF);
      float* cp = c + r * ldc + v * 16;
      __m512 x = acc[r][v];
      if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, cp));
      _mm512_mask_storeu_ps(cp, m, x);
    }
}

using UkF32 = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int, bool);
using UkBf16 = void (*)(int64_t, const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, float*, int64_t,
                        int, bool);
#define MLACP_UK_ROW(fn, MR) {&fn<MR, 1>, &fn<MR, 2>, &fn<MR, 3>, &fn<MR, 4>}
const UkF32 kUkF32[kMR][kNV] = {MLACP_UK_ROW(ukernel_f32, 1), MLACP_UK_ROW(ukernel_f32, 2),
                                MLACP_UK_ROW(ukernel_f32, 3), MLACP_UK_ROW(ukernel_f32, 4)};
const UkBf16 kUkBf16[kMR][kNV] = {MLACP_UK_ROW(ukernel_bf16, 1), MLACP_UK_ROW(ukernel_bf16, 2),
                                  MLACP_UK_ROW(ukernel_bf16, 3), MLACP_UK_ROW(ukernel_bf16, 4)};
#undef MLACP_UK_ROW

// AVX2 + FMA (no AVX-512): C[MR × cols] (=|+=) Σ_p A(r, p) · B[p][0..NV·8), cols = (NV−1)·8 +
// last, for one strip of a panel. MR × NV accumulators, NV B vectors and one broadcast fit the
// 16 ymm registers.
constexpr int kAvx2Lanes = 8;
constexpr int kAvx2Rows = 6, kAvx2StripVectors = 2;  // 6 x 16: 12 accumulators (BLIS's Haswell shape)

MLACP_AVX2 inline __m256i avx2_lane_mask(int valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int MR, int NV>
MLACP_AVX2 void ukernel_f32_avx2(int64_t k, const float* a, int64_t rs, int64_t cs, const float* b, int64_t ldb,
                                 float* c, int64_t ldc, int last, bool accumulate) {
  __m256 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm256_loadu_ps(b + p * ldb + v * kAvx2Lanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * rs + p * cs);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
  const __m256i last_mask = avx2_lane_mask(last);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + v * kAvx2Lanes;
      __m256 x = acc[r][v];
      if (v < NV - 1 || last == kAvx2Lanes) {
        if (accumulate) x = _mm256_add_ps(x, _mm256_loadu_ps(cp));
        _mm256_storeu_ps(cp, x);
      } else {
        if (accumulate) x = _mm256_add_ps(x, _mm256_maskload_ps(cp, last_mask));
        _mm256_maskstore_ps(cp, last_mask, x);
      }
    }
}

using UkF32Avx2 = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int, bool);
template <int MR, size_t... V>
constexpr std::array<UkF32Avx2, sizeof...(V)> avx2_row(std::index_sequence<V...>) {
  return {&ukernel_f32_avx2<MR, static_cast<int>(V) + 1>...};
}
template <size_t... R>
constexpr std::array<std::array<UkF32Avx2, kAvx2StripVectors>, sizeof...(R)> avx2_table(std::index_sequence<R...>) {
  return {avx2_row<static_cast<int>(R) + 1>(std::make_index_sequence<kAvx2StripVectors>{})...};
}
constexpr auto kUkF32Avx2 = avx2_table(std::make_index_sequence<kAvx2Rows>{});

// C[m × n] (=|+=) A · B (strip-major panels) on AVX2: per panel, strips of NV·8 columns (the
// strip, K × 64 contiguous bytes, stays in L1 while every row block of A passes over it), then
// MR-row blocks.
MLACP_AVX2 void gemm_f32_avx2(int64_t m, int64_t n, int64_t k, const float* a, int64_t rs, int64_t cs, const float* b,
                              float* c, int64_t ldc, bool accumulate, int64_t n_store) {
  constexpr int64_t strip = kAvx2Lanes * kAvx2StripVectors;
  static_assert(strip == kStripCols, "the micro-kernel's strip is the panel's");
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int64_t w = round_up(std::min(kNR, n - n0), kLanes);
    const int64_t cols = std::min(w, n_store - n0);
    const float* bp = b + (n0 / kNR) * k * kNR;
    for (int64_t s0 = 0; s0 < cols; s0 += strip) {
      const int64_t valid = std::min(strip, cols - s0);
      const int64_t nv = ceil_div(valid, kAvx2Lanes);
      const int last = static_cast<int>(valid - (nv - 1) * kAvx2Lanes);
      for (int64_t i = 0; i < m; i += kAvx2Rows) {
        const int64_t mr = std::min<int64_t>(kAvx2Rows, m - i);
        kUkF32Avx2[mr - 1][nv - 1](k, a + i * rs, rs, cs, bp + s0 * k, strip, c + i * ldc + n0 + s0, ldc, last,
                                   accumulate);
      }
    }
  }
}

// AMX: C[m × n] (=|+=) A · B on tiles, 32 × 32 of C at a time: tiles 0-3 hold C (rows 0-15 and
// 16-31 × columns 0-15 and 16-31, 16 × 16 float32 each), tiles 4-5 the two 16-row × 16-pair
// chunks of A, tiles 6-7 two chunks of B (16 pairs × 16 columns: the packed panel rows, already
// in the pair layout TDPBF16PS reads). Each chunk step loads 2 A and 2 B tiles for 4 products, so
// a load never waits on the product before it. A is read in place where its rows are
// pair-contiguous (cs = 2) and whole (32 rows, whole chunks); else its 32-row block is copied
// once, zero-padded to whole chunks: rows past m are zeros, and A stored pair-transposed (rs = 2:
// P and dS key pairs) is turned by 16 × 16 transposes of 32-bit pairs. A panel's partial last
// chunk is copied zero-padded. A whole C tile (16 rows × 16 columns of C) is loaded from C when
// accumulating (C + chunk + chunk ...) and stored in place; a partial one starts at zero and
// leaves through a scratch tile, where its rows, columns and `accumulate` are applied with
// AVX-512 masks (C + Σ chunks).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// r[k] = column k of the 16 × 16 matrix of 32-bit elements whose rows were r[0..15].
MLACP_AVX512 inline void transpose16x16_u32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[g·4 + c]: column 4·lane + c of rows 4g..4g+3, per 128-bit lane
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i lo01 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi01 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i lo23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    r[c] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + c] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + c] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// C[rows × lanes] (=|+=) tile[rows × lanes] (tile rows 16 floats apart).
MLACP_AVX512 void add_tile(const float* tile, int64_t rows, int64_t lanes, float* c, int64_t ldc, bool accumulate) {
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 x = _mm512_load_ps(tile + r * 16);
    if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, c + r * ldc));
    _mm512_mask_storeu_ps(c + r * ldc, mask, x);
  }
}

MLACP_AMX void gemm_amx(int64_t m, int64_t n, int64_t ku, const c10::BFloat16* a, int64_t rs, int64_t cs,
                        const c10::BFloat16* b, float* c, int64_t ldc, bool accumulate, int64_t n_store) {
  using E = c10::BFloat16;
  constexpr int64_t kPairsPerChunk = 16, kChunkElems = 2 * kPairsPerChunk;  // 64 bytes per tile row
  constexpr int64_t kRows = 32;                                             // C rows per step
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t chunks = ceil_div(ku, kPairsPerChunk), rem = ku - (chunks - 1) * kPairsPerChunk;
  const int64_t a_ld = chunks * kChunkElems;  // elements per row of the A copy
  thread_local std::vector<E> a_copy;
  if (a_copy.size() < static_cast<size_t>(kRows * a_ld)) a_copy.resize(static_cast<size_t>(kRows * a_ld));
  alignas(64) E b_tail[kNV][kPairsPerChunk * kChunkElems];
  alignas(64) float c_tile[16 * 16];
  for (int64_t i0 = 0; i0 < m; i0 += kRows) {
    const int64_t mr = std::min(kRows, m - i0);
    const bool two_rows = mr > 16;
    const E* a_tiles = a + i0 * rs;  // where tiles 4-5 read: A in place, or its copy
    int64_t a_stride = rs;           // elements between A's rows there
    if (cs != 2 || mr < kRows || rem < kPairsPerChunk) {
      a_tiles = a_copy.data(), a_stride = a_ld;
      if (rs == 2 && cs % 2 == 0) {  // pair-transposed: pair (r, p) at a + 2r + p·cs
        for (int64_t h = 0; h < kRows; h += 16) {
          const auto* src = reinterpret_cast<const uint32_t*>(a + (i0 + h) * rs);
          const int64_t valid = std::clamp<int64_t>(mr - h, 0, 16);
          const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1);
          for (int64_t j = 0; j < chunks; ++j) {
            __m512i t[16];
            for (int64_t q = 0; q < 16; ++q) {
              const int64_t p = j * kPairsPerChunk + q;
              t[q] = p < ku && valid > 0 ? _mm512_maskz_loadu_epi32(rows, src + p * (cs / 2)) : _mm512_setzero_si512();
            }
            transpose16x16_u32(t);
            for (int64_t r = 0; r < 16; ++r)
              _mm512_storeu_si512(a_copy.data() + (h + r) * a_ld + j * kChunkElems, t[r]);
          }
        }
      } else {
        for (int64_t r = 0; r < kRows; ++r) {
          E* dst = a_copy.data() + r * a_ld;
          int64_t p = 0;
          if (r < mr) {
            const E* src = a + (i0 + r) * rs;
            if (cs == 2) {
              std::memcpy(dst, src, static_cast<size_t>(2 * ku) * sizeof(E));
              p = ku;
            } else {
              for (; p < ku; ++p) std::memcpy(dst + 2 * p, src + p * cs, 2 * sizeof(E));
            }
          }
          std::memset(static_cast<void*>(dst + 2 * p), 0, static_cast<size_t>(a_ld - 2 * p) * sizeof(E));
        }
      }
    }
    const E* a_hi = a_tiles + 16 * a_stride;
    const int64_t a_bytes = a_stride * static_cast<int64_t>(sizeof(E));
    for (int64_t n0 = 0; n0 < n; n0 += kNR) {
      const int64_t w = round_up(std::min(kNR, n - n0), kLanes), nv = w / kLanes;
      const int64_t cols = std::min(w, n_store - n0), ldb = w * 2;
      const E* bp = b + (n0 / kNR) * ku * kNR * 2;
      if (rem < kPairsPerChunk)
        for (int64_t v = 0; v < nv; ++v) {
          std::memset(static_cast<void*>(b_tail[v]), 0, sizeof b_tail[v]);
          for (int64_t p = 0; p < rem; ++p)
            std::memcpy(b_tail[v] + p * kChunkElems, bp + ((chunks - 1) * kPairsPerChunk + p) * ldb + v * kChunkElems,
                        kChunkElems * sizeof(E));
        }
      for (int64_t v0 = 0; v0 < nv; v0 += 2) {
        const bool two_cols = v0 + 1 < nv;
        // A whole C tile is loaded (accumulate) or zeroed, summed into and stored in place; a partial
        // one starts at zero and leaves through c_tile and masks.
        auto whole = [&](int64_t r0, int64_t v) { return mr - r0 >= 16 && cols - v * kLanes >= kLanes; };
        auto at = [&](int64_t r0, int64_t v) { return c + (i0 + r0) * ldc + n0 + v * kLanes; };
        const int64_t c_bytes = ldc * static_cast<int64_t>(sizeof(float)), t_bytes = 16 * sizeof(float);
#define MLACP_AMX_INIT(T, R0, V)                                 \
  if (accumulate && whole(R0, V)) {                              \
    _tile_loadd(T, at(R0, V), c_bytes);                          \
  } else {                                                       \
    _tile_zero(T);                                               \
  }
        MLACP_AMX_INIT(0, 0, v0)
        MLACP_AMX_INIT(1, 0, v0 + 1)
        MLACP_AMX_INIT(2, 16, v0)
        MLACP_AMX_INIT(3, 16, v0 + 1)
#undef MLACP_AMX_INIT
        for (int64_t j = 0; j < chunks; ++j) {
          const bool tail = j == chunks - 1 && rem < kPairsPerChunk;
          auto src = [&](int64_t v) { return tail ? b_tail[v] : bp + j * kPairsPerChunk * ldb + v * kChunkElems; };
          const int64_t b_bytes = (tail ? kChunkElems : ldb) * static_cast<int64_t>(sizeof(E));
          _tile_loadd(4, a_tiles + j * kChunkElems, a_bytes);
          _tile_loadd(6, src(v0), b_bytes);
          _tile_dpbf16ps(0, 4, 6);
          if (two_rows) {
            _tile_loadd(5, a_hi + j * kChunkElems, a_bytes);
            _tile_dpbf16ps(2, 5, 6);
          }
          if (two_cols) {
            _tile_loadd(7, src(v0 + 1), b_bytes);
            _tile_dpbf16ps(1, 4, 7);
            if (two_rows) _tile_dpbf16ps(3, 5, 7);
          }
        }
        // C tile (row half r0, column vector v): in place, or through c_tile and masks.
        auto finish = [&](int64_t r0, int64_t v) {
          const int64_t rows = std::min<int64_t>(16, mr - r0), lanes = std::min<int64_t>(kLanes, cols - v * kLanes);
          if (rows > 0 && lanes > 0) add_tile(c_tile, rows, lanes, c + (i0 + r0) * ldc + n0 + v * kLanes, ldc, accumulate);
        };
#define MLACP_AMX_STORE(T, R0, V)               \
  if (whole(R0, V)) {                           \
    _tile_stored(T, at(R0, V), c_bytes);        \
  } else {                                      \
    _tile_stored(T, c_tile, t_bytes);           \
    finish(R0, V);                              \
  }
        MLACP_AMX_STORE(0, 0, v0)
        if (two_cols) {
          MLACP_AMX_STORE(1, 0, v0 + 1)
        }
        if (two_rows) {
          MLACP_AMX_STORE(2, 16, v0)
          if (two_cols) {
            MLACP_AMX_STORE(3, 16, v0 + 1)
          }
        }
#undef MLACP_AMX_STORE
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

bool cpu_has_amx_bf16() {
#if MLACP_X86
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

// C[M × N] (=|+=) A[M × K] · B (panels). Columns [N, n_store) of C are written too (zeros
// from B's padding) so score tiles have finite padding lanes; n_store ≤ round_up(N, 16).
template <class P>
void gemm(int64_t m, int64_t n, int64_t k, const typename P::E* a, int64_t rs, int64_t cs, const typename P::E* b,
          typename P::Acc* c, int64_t ldc, bool accumulate, int64_t n_store) {
  using Acc = typename P::Acc;
  n_store = std::max(n, n_store);
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n_store, Acc(0));
    return;
  }
  const int64_t ku = P::kPairs ? ceil_div(k, 2) : k;
  const int64_t unit = P::kPairs ? 2 : 1;
#if MLACP_X86
  if constexpr (P::kAmx) return gemm_amx(m, n, ku, a, rs, cs, b, c, ldc, accumulate, n_store);
  if constexpr (P::kAvx2) return gemm_f32_avx2(m, n, k, a, rs, cs, b, c, ldc, accumulate, n_store);
#endif
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int64_t w = round_up(std::min(kNR, n - n0), kLanes);
    const int64_t cols = std::min(w, n_store - n0);
    const int64_t nv = w / kLanes;
    const auto* bp = b + (n0 / kNR) * ku * kNR * unit;
    for (int64_t i = 0; i < m; i += kMR) {
      const int64_t mr = std::min(kMR, m - i);
      if constexpr (!P::kAvx) {
        ukernel_portable(mr, w, cols, ku, a + i * rs, rs, cs, bp, c + i * ldc + n0, ldc, accumulate);
      } else {
#if MLACP_X86
        const int last = static_cast<int>(cols - (nv - 1) * kLanes);
        if constexpr (P::kPairs)
          kUkBf16[mr - 1][nv - 1](ku, a + i * rs, rs, cs, bp, w * 2, c + i * ldc + n0, ldc, last, accumulate);
        else
          kUkF32[mr - 1][nv - 1](ku, a + i * rs, rs, cs, bp, w, c + i * ldc + n0, ldc, last, accumulate);
#endif
      }
    }
  }
}

// One instantiation per path that dispatch_path (blockwise_attention.cpp) can run.
#define MLACP_GEMM(P)                                                                                          \
  template void gemm<P>(int64_t, int64_t, int64_t, const P::E*, int64_t, int64_t, const P::E*, P::Acc*, int64_t, \
                        bool, int64_t);
MLACP_GEMM(F64Portable)
MLACP_GEMM(F32Portable)
#if MLACP_X86
MLACP_GEMM(F32Avx512)
MLACP_GEMM(Bf16Avx512)
MLACP_GEMM(Bf16Amx)
MLACP_GEMM(Bf16ViaF32Avx512)
MLACP_GEMM(F32Avx2)
MLACP_GEMM(Bf16ViaF32Avx2)
#endif
#undef MLACP_GEMM

bool bf16_dot_outruns_f32_fma(double* dot_gflops, double* fma_gflops) {
  struct Rates {
    double dot = 0, fma = 0;
    bool dot_wins = false;
  };
  static const Rates rates = [] {
    Rates r;
#if MLACP_X86
    if (!cpu_has_avx512_bf16()) return r;
    // One full 4 x 64 micro-tile over K = 128 (B panels of 16 KiB bf16 / 32 KiB float32, in
    // cache), called back to back; best of 5 interleaved rounds of each.
    constexpr int64_t k = 128, calls = 1500;
    std::vector<float> a32(kMR * k, 0.5f), b32(k * kNR, 0.25f), c(kMR * kNR);
    std::vector<c10::BFloat16> a16(kMR * k, c10::BFloat16(0.5f)), b16(k * kNR, c10::BFloat16(0.25f));
    const double flops = 2.0 * kMR * kNR * k * calls;
    auto time = [&](auto&& body) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < calls; ++i) body();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    double best_dot = 1e30, best_fma = 1e30;
    for (int round = 0; round < 5; ++round) {
      best_fma = std::min(best_fma, time([&] {
        kUkF32[kMR - 1][kNV - 1](k, a32.data(), k, 1, b32.data(), kNR, c.data(), kNR, 16, false);
      }));
      best_dot = std::min(best_dot, time([&] {
        kUkBf16[kMR - 1][kNV - 1](k / 2, a16.data(), k, 2, b16.data(), 2 * kNR, c.data(), kNR, 16, false);
      }));
    }
    volatile float sink = c[0];
    (void)sink;
    r.dot = flops / best_dot * 1e-9, r.fma = flops / best_fma * 1e-9;
    r.dot_wins = r.dot >= 1.25 * r.fma;
#endif
    return r;
  }();
  if (dot_gflops) *dot_gflops = rates.dot;
  if (fma_gflops) *fma_gflops = rates.fma;
  return rates.dot_wins;
}

double amx_bf16_gflops() {
  static const double rate = [] {
    double r = 0;
#if MLACP_X86
    if (!cpu_has_amx_bf16()) return r;
    constexpr int64_t m = 64, n = 64, k = 128, calls = 1500;
    std::vector<c10::BFloat16> a(m * k, c10::BFloat16(0.5f)), b(k * n, c10::BFloat16(0.25f));
    std::vector<float> c(m * n);
    double best = 1e30;
    for (int round = 0; round < 5; ++round) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < calls; ++i) gemm<Bf16Amx>(m, n, k, a.data(), k, 2, b.data(), c.data(), n, false);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    volatile float sink = c[0];
    (void)sink;
    r = 2.0 * m * n * k * calls / best * 1e-9;
#endif
    return r;
  }();
  return rate;
}

}  // namespace mlacp::blockwise_detail
