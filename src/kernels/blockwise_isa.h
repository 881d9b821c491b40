// Blockwise attention internals: ISA macros (AVX-512 target attributes, target_clones), the
// precision policy of each code path, run-time CPU feature checks and micro-kernel constants.
#pragma once

#include <cstdint>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MLACP_X86 1
#include <immintrin.h>
#define MLACP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define MLACP_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))
#define MLACP_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16,amx-tile,amx-bf16")))
// x86-64-v3: the AVX2 + FMA machines without AVX-512 (AMD Zen 1-3, Intel before Skylake-SP).
#define MLACP_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
// GCC 12 reports its own _mm512_undefined_ps() inside _mm512_max_ps & co. as maybe-uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#else
#define MLACP_X86 0
#endif

// Portable hot loops are also compiled for x86-64-v3 (AVX2, FMA) and picked at load time (ifunc).
#if MLACP_X86 && defined(__GNUC__) && !defined(__clang__)
#define MLACP_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MLACP_CLONES
#endif

namespace mlacp::blockwise_detail {

constexpr int64_t kLanes = 16;            // float32 lanes per AVX-512 vector
constexpr int64_t kMR = 4;                // micro-kernel rows
constexpr int64_t kNV = 4;                // micro-kernel vectors per row
constexpr int64_t kNR = kLanes * kNV;     // micro-kernel (= panel) columns

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------------------------
// Paths: element type E of GEMM operands, accumulator Acc, and whether K is consumed in pairs.
struct F64Portable {
  using E = double;
  using Acc = double;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = false;
  static constexpr bool kAvx2 = false;  // AVX2 + FMA micro-kernels and softmax (8 lanes)
  static constexpr bool kRoundBf16 = false;
  static constexpr bool kAmx = false;
};
struct F32Portable {
  using E = float;
  using Acc = float;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = false;
  static constexpr bool kAvx2 = false;
  static constexpr bool kRoundBf16 = false;
  static constexpr bool kAmx = false;
};
struct F32Avx512 {
  using E = float;
  using Acc = float;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = true;
  static constexpr bool kAvx2 = false;
  static constexpr bool kRoundBf16 = false;
  static constexpr bool kAmx = false;
};
// bf16 products and float32 sums in AVX-512-BF16's dot-product instruction.
struct Bf16Avx512 {
  using E = c10::BFloat16;
  using Acc = float;
  static constexpr bool kPairs = true;
  static constexpr bool kAvx = true;
  static constexpr bool kAvx2 = false;
  static constexpr bool kRoundBf16 = false;
  static constexpr bool kAmx = false;
};
// The same operands and sums on AMX tiles (TDPBF16PS: 16 x 16 float32 outputs per instruction,
// bf16 pairs): every GEMM of the bf16 path on the tile unit, the rest as in Bf16Avx512.
struct Bf16Amx : Bf16Avx512 {
  static constexpr bool kAmx = true;
};
// bf16 semantics on float32 FMAs: operands are bf16 values (bf16 tensors widened; float32
// inputs under bf16 autocast rounded to bf16 first) held as float32, so each product is exact
// and the sums are float32; P and dS stay float32. On CPUs whose bf16 dot product is slower than
// their float32 FMAs (bf16_path_choice) this is the fast bf16 path.
struct Bf16ViaF32Avx512 {
  using E = float;
  using Acc = float;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = true;
  static constexpr bool kAvx2 = false;
  static constexpr bool kRoundBf16 = true;
  static constexpr bool kAmx = false;
};

// float32 on AVX2 + FMA (8-lane vectors), for CPUs without AVX-512.
struct F32Avx2 : F32Portable {
  static constexpr bool kAvx2 = true;
};
// bf16 semantics on AVX2 float32 FMAs, as Bf16ViaF32Avx512.
struct Bf16ViaF32Avx2 : F32Avx2 {
  static constexpr bool kRoundBf16 = true;
};

template <class T>
constexpr at::ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<T, double>) return at::kDouble;
  if constexpr (std::is_same_v<T, float>) return at::kFloat;
  return at::kBFloat16;
}

inline bool cpu_has_avx512() {
#if MLACP_X86
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

inline bool cpu_has_avx2_fma() {
#if MLACP_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

inline bool cpu_has_avx512_bf16() {
#if MLACP_X86
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// AMX-BF16 tiles, usable by this process: the CPU has them (CPUID) and Linux granted the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process).
bool cpu_has_amx_bf16();

#if MLACP_X86
// Interleaves two 16-lane bf16 rows into 16 pairs (bf16 B panels and P/dS pair layouts).
[[maybe_unused]]
alignas(64) const uint16_t kInterleave16[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#endif

}  // namespace mlacp::blockwise_detail
