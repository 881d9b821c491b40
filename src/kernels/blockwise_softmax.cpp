// Blockwise attention softmax steps, AVX-512 float32, AVX-512-BF16 and AVX2 float32: vectorized exp, online
// max / sum per query lane, and bf16 key-pair outputs for the following GEMMs.
#include "kernels/blockwise_softmax.h"

namespace mlacp::blockwise_detail {

#if MLACP_X86
namespace {

// exp(x), ~1 ulp on the range softmax uses; exactly 0 below −87 (so exp(−inf) = 0), NaN kept.
MLACP_AVX512 inline __m512 exp_ps(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
}

// m_new = max(m, scale·max_j S); returns m_new with −inf replaced by 0 (the safe subtrahend).
MLACP_AVX512 inline __m512 update_max(const float* st, int64_t rows, int64_t ld, __m512 scale, float* m, float* alpha) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < rows; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(st + j * ld));
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx, scale));
  const __m512 safe = _mm512_mask_blend_ps(
      _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ), m_new,
      _mm512_setzero_ps());
  _mm512_storeu_ps(m, m_new);
  _mm512_storeu_ps(alpha, exp_ps(_mm512_sub_ps(m_old, safe)));
  return safe;
}

// Two f32 rows -> 16 bf16 pairs (row0 low, row1 high).
MLACP_AVX512BF16 inline __m512i pair_rows(__m512 row0, __m512 row1) {
  const __m512bh packed = _mm512_cvtne2ps_pbh(row1, row0);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave16), reinterpret_cast<const __m512i&>(packed));
}

MLACP_AVX512BF16 void store_bf16(c10::BFloat16* dst, __m512 x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(h));
}

// exp(x) on 8 lanes, the same polynomial as exp_ps; 2^n built in the exponent field.
MLACP_AVX2 inline __m256 exp_ps_avx2(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n in [−127, 127]: 2^n = (n + 127) << 23 (n = −127 gives 0, and such lanes are zeroed below).
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);  // NaN lanes kept
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  const __m256 out = _mm256_blendv_ps(_mm256_and_ps(v, keep), _mm256_set1_ps(std::numeric_limits<float>::infinity()), big);
  return _mm256_blendv_ps(out, x, nan);
}

// As update_max, on 8 lanes.
MLACP_AVX2 inline __m256 update_max_avx2(const float* st, int64_t rows, int64_t ld, __m256 scale, float* m,
                                         float* alpha) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = ninf;
  for (int64_t j = 0; j < rows; ++j) mx = _mm256_max_ps(mx, _mm256_loadu_ps(st + j * ld));
  const __m256 m_old = _mm256_loadu_ps(m);
  const __m256 m_new = _mm256_max_ps(m_old, _mm256_mul_ps(mx, scale));
  const __m256 safe = _mm256_andnot_ps(_mm256_cmp_ps(m_new, ninf, _CMP_EQ_OQ), m_new);
  _mm256_storeu_ps(m, m_new);
  _mm256_storeu_ps(alpha, exp_ps_avx2(_mm256_sub_ps(m_old, safe)));
  return safe;
}

}  // namespace

MLACP_AVX2 void softmax_step_f32_avx2(int64_t rows, int64_t ld, float* st, float scale, float* m, float* l,
                                      float* alpha) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 8) {
    const __m256 safe = update_max_avx2(st + c, rows, ld, vs, m + c, alpha + c);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < rows; ++j) {
      float* s = st + j * ld + c;
      const __m256 e = exp_ps_avx2(_mm256_fmsub_ps(_mm256_loadu_ps(s), vs, safe));
      _mm256_storeu_ps(s, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(l + c, _mm256_fmadd_ps(_mm256_loadu_ps(l + c), _mm256_loadu_ps(alpha + c), sum));
  }
}

MLACP_AVX2 void backward_step_f32_avx2(int64_t rows, int64_t ld, float* st, float* dpt, float scale,
                                       const float* lse, const float* delta) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 8) {
    const __m256 lv = _mm256_loadu_ps(lse + c), dv = _mm256_loadu_ps(delta + c);
    for (int64_t j = 0; j < rows; ++j) {
      float* s = st + j * ld + c;
      float* d = dpt + j * ld + c;
      const __m256 p = exp_ps_avx2(_mm256_fmsub_ps(_mm256_loadu_ps(s), vs, lv));
      _mm256_storeu_ps(s, p);
      _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(d), dv)), vs));
    }
  }
}

MLACP_AVX512 void softmax_step_f32(int64_t rows, int64_t ld, float* st, float scale, float* m, float* l,
                                   float* alpha) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 16) {
    const __m512 safe = update_max(st + c, rows, ld, vs, m + c, alpha + c);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < rows; ++j) {
      float* s = st + j * ld + c;
      const __m512 e = exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s), vs, safe));
      _mm512_storeu_ps(s, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), _mm512_loadu_ps(alpha + c), sum));
  }
}

// As softmax_step_f32, but P goes to `pw` as bf16 key pairs: pw[(j/2)·ld + i] = (P_ij, P_i,j+1).
MLACP_AVX512BF16 void softmax_step_bf16(int64_t rows, int64_t ld, float* st, float scale, float* m, float* l,
                                        float* alpha, c10::BFloat16* pw) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 16) {
    const __m512 safe = update_max(st + c, rows, ld, vs, m + c, alpha + c);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < rows; j += 2) {
      const __m512 e0 = exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(st + j * ld + c), vs, safe));
      const __m512 e1 = j + 1 < rows ? exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(st + (j + 1) * ld + c), vs, safe))
                                     : _mm512_setzero_ps();
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(pw + ((j / 2) * ld + c) * 2, pair_rows(e0, e1));
    }
    _mm512_storeu_ps(l + c, _mm512_fmadd_ps(_mm512_loadu_ps(l + c), _mm512_loadu_ps(alpha + c), sum));
  }
}

// P^T = exp(S^T·scale − lse) (in place), dS^T = P^T ∘ (dP^T − D)·scale (in place of dP^T).
MLACP_AVX512 void backward_step_f32(int64_t rows, int64_t ld, float* st, float* dpt, float scale, const float* lse,
                                    const float* delta) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 16) {
    const __m512 lv = _mm512_loadu_ps(lse + c), dv = _mm512_loadu_ps(delta + c);
    for (int64_t j = 0; j < rows; ++j) {
      float* s = st + j * ld + c;
      float* d = dpt + j * ld + c;
      const __m512 p = exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s), vs, lv));
      _mm512_storeu_ps(s, p);
      _mm512_storeu_ps(d, _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(d), dv)), vs));
    }
  }
}

// bf16 outputs: P^T rows (pt), dS^T rows (dst) and dS key pairs (dsw, layout as in softmax_step_bf16).
MLACP_AVX512BF16 void backward_step_bf16(int64_t rows, int64_t ld, const float* st, const float* dpt, float scale,
                                         const float* lse, const float* delta, c10::BFloat16* pt,
                                         c10::BFloat16* dst, c10::BFloat16* dsw) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 16) {
    const __m512 lv = _mm512_loadu_ps(lse + c), dv = _mm512_loadu_ps(delta + c);
    for (int64_t j = 0; j < rows; j += 2) {
      __m512 ds[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t h = 0; h < 2 && j + h < rows; ++h) {
        const int64_t off = (j + h) * ld + c;
        const __m512 p = exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(st + off), vs, lv));
        ds[h] = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dpt + off), dv)), vs);
        store_bf16(pt + off, p);
        store_bf16(dst + off, ds[h]);
      }
      _mm512_storeu_si512(dsw + ((j / 2) * ld + c) * 2, pair_rows(ds[0], ds[1]));
    }
  }
}
#endif

}  // namespace mlacp::blockwise_detail
