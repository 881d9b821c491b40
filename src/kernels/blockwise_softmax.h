// Blockwise attention internals: element-wise work on score tiles (online-softmax forward step,
// P / dS backward step), AVX-512 float32, AVX-512-BF16, AVX2 float32 and portable.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <c10/util/BFloat16.h>

#include "kernels/blockwise_isa.h"

namespace mlacp::blockwise_detail {

// Tiles are S^T [rows = keys][ld = padded query lanes]; m, l, alpha, lse, delta are per query lane.
#if MLACP_X86
// Online softmax over the tile's keys: updates m, l, alpha; S^T becomes exp(S^T·scale − m).
MLACP_AVX512 void softmax_step_f32(int64_t rows, int64_t ld, float* st, float scale, float* m, float* l,
                                   float* alpha);
// As softmax_step_f32, but P goes to `pw` as bf16 key pairs: pw[(j/2)·ld + i] = (P_ij, P_i,j+1).
MLACP_AVX512BF16 void softmax_step_bf16(int64_t rows, int64_t ld, float* st, float scale, float* m, float* l,
                                        float* alpha, c10::BFloat16* pw);
// P^T = exp(S^T·scale − lse) (in place), dS^T = P^T ∘ (dP^T − D)·scale (in place of dP^T).
MLACP_AVX512 void backward_step_f32(int64_t rows, int64_t ld, float* st, float* dpt, float scale, const float* lse,
                                    const float* delta);
// bf16 outputs: P^T rows (pt), dS^T rows (dst) and dS key pairs (dsw, layout as in softmax_step_bf16).
MLACP_AVX512BF16 void backward_step_bf16(int64_t rows, int64_t ld, const float* st, const float* dpt, float scale,
                                         const float* lse, const float* delta, c10::BFloat16* pt,
                                         c10::BFloat16* dst, c10::BFloat16* dsw);
// The same two steps on AVX2 + FMA (8 lanes), for CPUs without AVX-512.
MLACP_AVX2 void softmax_step_f32_avx2(int64_t rows, int64_t ld, float* st, float scale, float* m, float* l,
                                      float* alpha);
MLACP_AVX2 void backward_step_f32_avx2(int64_t rows, int64_t ld, float* st, float* dpt, float scale,
                                       const float* lse, const float* delta);
#endif

template <class Acc>
void softmax_step_portable(int64_t rows, int64_t ld, Acc* st, Acc scale, Acc* m, Acc* l, Acc* alpha, Acc* safe,
                           Acc* sum) {
  const Acc ninf = -std::numeric_limits<Acc>::infinity();
  std::fill(safe, safe + ld, ninf);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < ld; ++i) safe[i] = std::max(safe[i], st[j * ld + i]);
  for (int64_t i = 0; i < ld; ++i) {
    const Acc m_new = std::max(m[i], safe[i] * scale);
    safe[i] = m_new == ninf ? Acc(0) : m_new;
    alpha[i] = std::exp(m[i] - safe[i]);
    m[i] = m_new;
    sum[i] = 0;
  }
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < ld; ++i) {
      const Acc e = std::exp(st[j * ld + i] * scale - safe[i]);
      st[j * ld + i] = e;
      sum[i] += e;
    }
  for (int64_t i = 0; i < ld; ++i) l[i] = l[i] * alpha[i] + sum[i];
}

template <class Acc>
void backward_step_portable(int64_t rows, int64_t ld, Acc* st, Acc* dpt, Acc scale, const Acc* lse, const Acc* delta) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < ld; ++i) {
      const Acc p = std::exp(st[j * ld + i] * scale - lse[i]);
      st[j * ld + i] = p;
      dpt[j * ld + i] = p * (dpt[j * ld + i] - delta[i]) * scale;
    }
}

}  // namespace mlacp::blockwise_detail
