// Blockwise attention internals: GEMM operands (tensor row views, element conversion, packed B
// panels) and the gemm<P> entry point; micro-kernels and gemm itself are in blockwise_gemm.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "kernels/blockwise_isa.h"

namespace mlacp::blockwise_detail {

// A [B,H,S,D] tensor read by rows: element (b,h,s,d) at base + (b*sb + h*sh + s*ss + d) * elem.
struct Rows4 {
  char* base = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t sb = 0, sh = 0, ss = 0, elem = 0;
  char* row(int64_t b, int64_t h, int64_t s) const { return base + (b * sb + h * sh + s * ss) * elem; }
};

inline Rows4 rows_of(const at::Tensor& t) {
  return {static_cast<char*>(t.data_ptr()), t.scalar_type(), t.stride(0), t.stride(1), t.stride(2),
          static_cast<int64_t>(t.element_size())};
}

// ---------------------------------------------------------------------------------------------
// Element conversions.
template <class Dst, class Src>
inline Dst convert_elem(Src x) {
  if constexpr (std::is_same_v<Src, c10::BFloat16>) return static_cast<Dst>(static_cast<float>(x));
  else return static_cast<Dst>(x);
}

#if MLACP_X86
// float32 → bf16 (round to nearest even), 16 lanes at a time.
MLACP_AVX512BF16 void f32_to_bf16_avx512(const float* src, int64_t n, c10::BFloat16* dst);
// bf16 → float32 (exact), 16 lanes at a time.
MLACP_AVX512 void bf16_to_f32_avx512(const c10::BFloat16* src, int64_t n, float* dst);
// bf16 → float32 (exact), 8 lanes at a time.
MLACP_AVX2 void bf16_to_f32_avx2(const c10::BFloat16* src, int64_t n, float* dst);
#endif

template <class P>
void convert_row(const char* src, at::ScalarType dtype, int64_t n, typename P::E* dst) {
  using E = typename P::E;
  switch (dtype) {
    case at::kDouble:
      for (int64_t i = 0; i < n; ++i) dst[i] = convert_elem<E>(reinterpret_cast<const double*>(src)[i]);
      break;
    case at::kFloat:
#if MLACP_X86
      if constexpr (P::kPairs && P::kAvx) {  // Bf16Avx512, Bf16Amx
        f32_to_bf16_avx512(reinterpret_cast<const float*>(src), n, dst);
        break;
      }
#endif
      if constexpr (P::kRoundBf16) {  // bf16 autocast on float32 inputs: the bf16 value, held as E
        for (int64_t i = 0; i < n; ++i)
          dst[i] = static_cast<E>(static_cast<float>(c10::BFloat16(reinterpret_cast<const float*>(src)[i])));
        break;
      }
      for (int64_t i = 0; i < n; ++i) dst[i] = convert_elem<E>(reinterpret_cast<const float*>(src)[i]);
      break;
    default:
#if MLACP_X86
      if constexpr (P::kAvx && std::is_same_v<E, float>) {
        bf16_to_f32_avx512(reinterpret_cast<const c10::BFloat16*>(src), n, dst);
        break;
      }
      if constexpr (P::kAvx2) {
        bf16_to_f32_avx2(reinterpret_cast<const c10::BFloat16*>(src), n, dst);
        break;
      }
#endif
      for (int64_t i = 0; i < n; ++i) dst[i] = convert_elem<E>(reinterpret_cast<const c10::BFloat16*>(src)[i]);
  }
}

template <class Acc>
void load_row_acc(const char* src, at::ScalarType dtype, int64_t n, Acc* dst) {
  switch (dtype) {
    case at::kDouble:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(reinterpret_cast<const double*>(src)[i]);
      break;
    case at::kFloat:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(reinterpret_cast<const float*>(src)[i]);
      break;
    default:
      for (int64_t i = 0; i < n; ++i)
        dst[i] = static_cast<Acc>(static_cast<float>(reinterpret_cast<const c10::BFloat16*>(src)[i]));
  }
}

// dst row (dtype) = src * factor
template <class Acc>
void store_row(const Acc* src, int64_t n, Acc factor, char* dst, at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<double*>(dst)[i] = static_cast<double>(src[i] * factor);
      break;
    case at::kFloat:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<float*>(dst)[i] = static_cast<float>(src[i] * factor);
      break;
    default:
      for (int64_t i = 0; i < n; ++i)
        reinterpret_cast<c10::BFloat16*>(dst)[i] = c10::BFloat16(static_cast<float>(src[i] * factor));
  }
}

// Rows [s0, s0+n) of (b,h) as E with leading dimension ld: in place when the tensor already
// holds E (and, for pair paths feeding an A operand, pairs never straddle a row end), else
// converted into `scratch` (zero-padded to an even width for pair paths).
template <class E>
struct RowsE {
  const E* ptr;
  int64_t ld;
};

template <class P>
RowsE<typename P::E> rows_as(const Rows4& src, int64_t b, int64_t h, int64_t s0, int64_t n, int64_t d,
                             typename P::E* scratch, bool a_operand) {
  using E = typename P::E;
  const bool pairs_ok = !P::kPairs || !a_operand || (d % 2 == 0 && src.ss % 2 == 0);
  if (src.dtype == scalar_type_of<E>() && pairs_ok && !P::kRoundBf16) return {reinterpret_cast<const E*>(src.row(b, h, s0)), src.ss};
  const int64_t ld = P::kPairs ? round_up(d, 2) : d;
  for (int64_t r = 0; r < n; ++r) {
    convert_row<P>(src.row(b, h, s0 + r), src.dtype, d, scratch + r * ld);
    for (int64_t c = d; c < ld; ++c) scratch[r * ld + c] = E(0);
  }
  return {scratch, ld};
}

// ---------------------------------------------------------------------------------------------
// B panels. A K×N operand B is stored as ceil(N/64) panels; panel j holds columns
// [64j, 64j + w) with w = round_up(min(64, N − 64j), 16), zero-padded:
//   plain paths  panel[p][w]        at offset j·K·64
//   pair paths   panel[p/2][w][2]   at offset j·ceil(K/2)·64·2   (element p of the pair in [2])
//   AVX2 paths   panel[w/16][p][16] at offset j·K·64: strip-major, so the 16-column strip the
//                micro-kernel reads is one contiguous K × 64-byte run. Row-major, a strip's rows
//                lie 256 bytes apart and map to a quarter of L1's sets: at K ≥ 128 they evict
//                each other before the next row block reads them again.
inline int64_t panel_elems(int64_t k, int64_t n) { return round_up(k, 2) * round_up(n, kNR); }
constexpr int64_t kStripCols = 16;  // columns per strip of an AVX2 panel (two 8-lane vectors)

// Offset of B[p][c] in its panel of width w (plain paths; K rows).
template <class P>
inline int64_t panel_offset(int64_t p, int64_t c, int64_t w, int64_t k) {
  if constexpr (P::kAvx2) return (c / kStripCols) * k * kStripCols + p * kStripCols + c % kStripCols;
  else return p * w + c;
}

#if MLACP_X86
// dst[2n + h] = row_h[n] for n < w (row1 may be null: zeros; columns ≥ valid: zeros).
MLACP_AVX512BF16 void interleave_rows_bf16(const c10::BFloat16* row0, const c10::BFloat16* row1, int64_t valid,
                                           int64_t w, c10::BFloat16* dst);
#endif

// B[p][n] = rows[p][n]: K rows of N features (V_j or K_j as B, Q_i or dO_i as B).
template <class P>
void pack_b_rows(RowsE<typename P::E> rows, int64_t k, int64_t n, typename P::E* out) {
  using E = typename P::E;
  const int64_t ku = P::kPairs ? ceil_div(k, 2) : k;
  const int64_t unit = P::kPairs ? 2 : 1;
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int64_t nw = std::min(kNR, n - n0), w = round_up(nw, kLanes);
    E* o = out + (n0 / kNR) * ku * kNR * unit;
    for (int64_t p = 0; p < ku; ++p) {
      if constexpr (P::kAvx2) {
        for (int64_t c0 = 0; c0 < w; c0 += kStripCols) {
          E* dst = o + panel_offset<P>(p, c0, w, k);
          const int64_t copy = std::clamp<int64_t>(nw - c0, 0, kStripCols);
          std::memcpy(dst, rows.ptr + p * rows.ld + n0 + c0, copy * sizeof(E));
          for (int64_t c = copy; c < kStripCols; ++c) dst[c] = E(0);
        }
      } else if constexpr (!P::kPairs) {
        std::memcpy(o + p * w, rows.ptr + p * rows.ld + n0, nw * sizeof(E));
        for (int64_t c = nw; c < w; ++c) o[p * w + c] = E(0);
      } else {
        const E* r0 = rows.ptr + (2 * p) * rows.ld + n0;
        const E* r1 = 2 * p + 1 < k ? rows.ptr + (2 * p + 1) * rows.ld + n0 : nullptr;
        E* dst = o + p * w * 2;
#if MLACP_X86
        if constexpr (P::kAvx) {
          interleave_rows_bf16(r0, r1, nw, w, dst);
          continue;
        }
#endif
        for (int64_t c = 0; c < w; ++c) {
          dst[2 * c] = c < nw ? r0[c] : E(0);
          dst[2 * c + 1] = c < nw && r1 ? r1[c] : E(0);
        }
      }
    }
  }
}

// B[p][n] = rows[n][p]: N rows of K features (Q_i^T, dO_i^T).
template <class P>
void pack_b_cols(RowsE<typename P::E> rows, int64_t n, int64_t k, typename P::E* out) {
  using E = typename P::E;
  const int64_t ku = P::kPairs ? ceil_div(k, 2) : k;
  const int64_t unit = P::kPairs ? 2 : 1;
  for (int64_t n0 = 0; n0 < n; n0 += kNR) {
    const int64_t nw = std::min(kNR, n - n0), w = round_up(nw, kLanes);
    E* o = out + (n0 / kNR) * ku * kNR * unit;
    for (int64_t c = 0; c < w; ++c) {
      const E* src = rows.ptr + (n0 + c) * rows.ld;
      for (int64_t p = 0; p < ku; ++p) {
        if constexpr (!P::kPairs) {
          o[panel_offset<P>(p, c, w, k)] = c < nw ? src[p] : E(0);
        } else {
          o[(p * w + c) * 2] = c < nw ? src[2 * p] : E(0);
          o[(p * w + c) * 2 + 1] = c < nw && 2 * p + 1 < k ? src[2 * p + 1] : E(0);
        }
      }
    }
  }
}


// C[M × N] (=|+=) A[M × K] · B (panels). Columns [N, n_store) of C are written too (zeros
// from B's padding) so score tiles have finite padding lanes; n_store ≤ round_up(N, 16).
template <class P>
void gemm(int64_t m, int64_t n, int64_t k, const typename P::E* a, int64_t rs, int64_t cs, const typename P::E* b,
          typename P::Acc* c, int64_t ldc, bool accumulate, int64_t n_store = 0);

// Whether this CPU's AVX-512-BF16 dot product (vdpbf16ps: 2 products per lane) outruns its
// float32 FMAs in arithmetic per second by a clear margin (1.25x): timed once per process on the
// two micro-kernels over cache-resident panels. Fills the measured rates (GFLOP/s, one thread).
bool bf16_dot_outruns_f32_fma(double* dot_gflops = nullptr, double* fma_gflops = nullptr);

// GFLOP/s of gemm<Bf16Amx> on one thread (a 64 x 64 x 128 product, its operand copies included,
// in cache; best of 5), timed once per process; 0 where cpu_has_amx_bf16() is false.
double amx_bf16_gflops();

}  // namespace mlacp::blockwise_detail
