// Blockwise attention: plan (checks, block classification), CPU micro-kernels, forward and
// backward drivers, autograd wiring. See blockwise_attention.h for the contract.
//
// Layout of one forward step (query block i, key block j; bq × bk tile):
//
//   K_j rows [bk, Dqk] ──A──┐
//   Q_i^T panels [Dqk, bq] ─B┴─> S^T [bk, bq]  ── mask, online softmax over the key axis
//                                   │             (query index = vector lane: m, l per lane)
//   P = (S^T)^T [bq, bk] ──A──┐     ▼
//   V_j panels [bk, Dv]  ──B──┴──> O_acc [bq, Dv] += P·V_j  (after O_acc *= alpha)
//
// Backward per query block i (dQ_i local), key blocks j in turn (dK/dV accumulate per head):
//   S^T = K_j·Q_i^T, dP^T = V_j·dO_i^T, P^T = exp(S^T·scale − lse_i),
//   dS^T = P^T ∘ (dP^T − D_i)·scale, dV_j += P^T·dO_i, dK_j += dS^T·Q_i, dQ_i += dS·K_j.
//
// Every GEMM is C[M×N] (+)= A·B with A read by scalar broadcast at arbitrary strides and B
// packed in 64-column panels, so no operand is transposed in memory except the packed panels.
// Micro-kernels: AVX-512F (float32 FMA) and AVX-512-BF16 (vdpbf16ps: bf16 pairs, float32
// sums), chosen at run time; portable C++ for float64 and CPUs without AVX-512.
#include "kernels/blockwise_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include <pthread.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <c10/util/BFloat16.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "mlacp/errors.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MLACP_X86 1
#include <immintrin.h>
#define MLACP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define MLACP_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))
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

namespace mlacp {
namespace {

constexpr const char* kWhat = "blockwise attention";
// 128 × 128 tiles: per-worker temporaries ~1 MB (float32, Dqk 192, Dv 128), far below the
// 32 MiB page-fault cliff. Measured at S=2048, 1 thread, fwd+bwd: 64×64 … 256×256 tiles all
// within ±5% (noise) of 128×128 (~97 GFLOP/s float32, ~185 bf16; micro-kernel peak 115 / 230).
constexpr int64_t kDefaultBlockQ = 128;
constexpr int64_t kDefaultBlockK = 128;
constexpr int64_t kMaxBlock = 4096;
constexpr int64_t kLanes = 16;            // float32 lanes per AVX-512 vector
constexpr int64_t kMR = 4;                // micro-kernel rows
constexpr int64_t kNV = 4;                // micro-kernel vectors per row
constexpr int64_t kNR = kLanes * kNV;     // micro-kernel (= panel) columns

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------------------------
// Paths: element type E of GEMM operands, accumulator Acc, and whether K is consumed in pairs.
struct F64Portable {
  using E = double;
  using Acc = double;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = false;
};
struct F32Portable {
  using E = float;
  using Acc = float;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = false;
};
struct F32Avx512 {
  using E = float;
  using Acc = float;
  static constexpr bool kPairs = false;
  static constexpr bool kAvx = true;
};
struct Bf16Avx512 {
  using E = c10::BFloat16;
  using Acc = float;
  static constexpr bool kPairs = true;
  static constexpr bool kAvx = true;
};

template <class T>
constexpr at::ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<T, double>) return at::kDouble;
  if constexpr (std::is_same_v<T, float>) return at::kFloat;
  return at::kBFloat16;
}

bool cpu_has_avx512() {
#if MLACP_X86
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if MLACP_X86
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------
// Work distribution. This library's translation units are compiled without -fopenmp, so the
// header-inlined at::parallel_for would run serially here; TensorIterator::for_each runs
// ATen's compiled parallel_for, i.e. the same OpenMP intra-op pool as ATen's own kernels.
//
// Fork safety: libgomp's pool does not survive fork(); a child forked after this process used
// the pool would hang in its next parallel region. A pthread_atfork handler marks such children
// and the kernel then runs serially in them (measured: without it the child hangs).
std::atomic<bool> g_pool_used{false};
std::atomic<bool> g_forked_after_pool{false};

void mark_forked_child() {
  if (g_pool_used.load()) g_forked_after_pool.store(true);
}

int64_t worker_count() {
  if (g_forked_after_pool.load() || at::in_parallel_region()) return 1;
  return std::max(1, at::get_num_threads());
}

void run_workers(int64_t n_workers, const std::function<void(int64_t)>& worker) {
  if (n_workers <= 1) {
    worker(0);
    return;
  }
  static const bool fork_handler = pthread_atfork(nullptr, nullptr, &mark_forked_child) == 0;
  (void)fork_handler;
  g_pool_used.store(true);
  const at::Tensor ids = at::arange(n_workers, at::kLong);
  at::TensorIterator iter = at::TensorIteratorConfig().add_input(ids).build();
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
        for (int64_t o = 0; o < size1; ++o)
          for (int64_t i = 0; i < size0; ++i)
            worker(*reinterpret_cast<const int64_t*>(data[0] + i * strides[0] + o * strides[1]));
      },
      /*grain_size=*/1);
}

// Pulls task indices from a shared counter (dynamic balance: causal rows differ in cost).
// `order` lists tasks most expensive first; setup(worker) returns that worker's state.
template <class State, class Setup, class Task, class Finish>
void run_tasks(const std::vector<int64_t>& order, Setup setup, Task task, Finish finish) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  run_workers(std::min<int64_t>(worker_count(), std::max<int64_t>(n, 1)), [&](int64_t worker) {
    State state = setup(worker);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) task(order[t], state);
    finish(state);
  });
}

std::vector<int64_t> order_by_cost(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

// ---------------------------------------------------------------------------------------------
// Plan: everything decided once per call (and replayed by backward).
enum class TileKind : uint8_t { skip, full, masked };

struct BlockInfo {
  int64_t begin, size;
  int64_t tok_min, tok_max, doc_min, doc_max;
};

// A [B,H,S,D] tensor read by rows: element (b,h,s,d) at base + (b*sb + h*sh + s*ss + d) * elem.
struct Rows4 {
  char* base = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t sb = 0, sh = 0, ss = 0, elem = 0;
  char* row(int64_t b, int64_t h, int64_t s) const { return base + (b * sb + h * sh + s * ss) * elem; }
};

Rows4 rows_of(const at::Tensor& t) {
  return {static_cast<char*>(t.data_ptr()), t.scalar_type(), t.stride(0), t.stride(1), t.stride(2),
          static_cast<int64_t>(t.element_size())};
}

// Row-wise masking of a score tile row (one key, query lanes): branch-free so it vectorizes.
template <class T>
MLACP_CLONES void mask_row_causal(T* row, int64_t n, const int64_t* q_tok, int64_t k_tok) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) row[i] = k_tok <= q_tok[i] ? row[i] : ninf;
}
template <class T>
MLACP_CLONES void mask_row_docs(T* row, int64_t n, const int64_t* q_doc, int64_t k_doc) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) row[i] = k_doc == q_doc[i] ? row[i] : ninf;
}

struct Plan {
  int64_t batch = 0, heads = 0, sq = 0, sk = 0, dqk = 0, dv = 0;
  int64_t block_q = 0, block_k = 0, nqb = 0, nkb = 0;
  double scaling = 1.0;
  bool causal = false;
  bool has_docs = false;
  at::ScalarType in_dtype = at::kFloat;   // q, k, v and outputs
  at::ScalarType acc_dtype = at::kFloat;  // lse and accumulators
  BlockwisePath path = BlockwisePath::automatic;
  std::vector<int64_t> q_tok, k_tok, q_doc, k_doc;
  std::vector<BlockInfo> q_blocks, k_blocks;
  at::Tensor mask;  // bool [B|1,1,Sq,Sk] or undefined
  const uint8_t* mask_data = nullptr;
  int64_t mask_sb = 0, mask_si = 0, mask_sj = 0;

  TileKind classify(int64_t qb, int64_t kb) const {
    const BlockInfo& q = q_blocks[qb];
    const BlockInfo& k = k_blocks[kb];
    if (causal && k.tok_min > q.tok_max) return TileKind::skip;
    if (has_docs && (k.doc_max < q.doc_min || k.doc_min > q.doc_max)) return TileKind::skip;
    const bool causal_full = !causal || k.tok_max <= q.tok_min;
    const bool docs_full = !has_docs || (q.doc_min == q.doc_max && k.doc_min == k.doc_max && q.doc_min == k.doc_min);
    return causal_full && docs_full && !mask_data ? TileKind::full : TileKind::masked;
  }
  bool mask_at(int64_t b, int64_t i, int64_t j) const {
    return mask_data[b * mask_sb + i * mask_si + j * mask_sj] != 0;
  }
  // Whether an explicit mask leaves any pair of the tile allowed (structure is in classify).
  bool mask_any(int64_t b, int64_t qb, int64_t kb) const {
    if (!mask_data) return true;
    const BlockInfo& q = q_blocks[qb];
    const BlockInfo& k = k_blocks[kb];
    for (int64_t i = q.begin; i < q.begin + q.size; ++i)
      for (int64_t j = k.begin; j < k.begin + k.size; ++j)
        if (mask_at(b, i, j)) return true;
    return false;
  }
  // S^T [k.size rows, ldS]: disallowed (key j, query i) entries become −inf.
  template <class Acc>
  void apply_mask(int64_t b, int64_t qb, int64_t kb, Acc* st, int64_t ld) const {
    const BlockInfo& q = q_blocks[qb];
    const BlockInfo& k = k_blocks[kb];
    for (int64_t j = 0; j < k.size; ++j) {
      Acc* row = st + j * ld;
      const int64_t key = k.begin + j;
      if (causal) mask_row_causal(row, q.size, q_tok.data() + q.begin, k_tok[key]);
      if (has_docs) mask_row_docs(row, q.size, q_doc.data() + q.begin, k_doc[key]);
      if (mask_data) {
        const uint8_t* m = mask_data + b * mask_sb + q.begin * mask_si + key * mask_sj;
        for (int64_t i = 0; i < q.size; ++i)
          if (!m[i * mask_si]) row[i] = -std::numeric_limits<Acc>::infinity();
      }
    }
  }
};

std::vector<int64_t> index_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::vector<BlockInfo> make_blocks(const std::vector<int64_t>& tok, const std::vector<int64_t>& doc, int64_t block) {
  std::vector<BlockInfo> blocks;
  for (int64_t begin = 0; begin < static_cast<int64_t>(tok.size()); begin += block) {
    BlockInfo info{begin, std::min<int64_t>(block, static_cast<int64_t>(tok.size()) - begin), tok[begin], tok[begin], 0,
                   0};
    if (!doc.empty()) info.doc_min = info.doc_max = doc[begin];
    for (int64_t i = begin; i < begin + info.size; ++i) {
      info.tok_min = std::min(info.tok_min, tok[i]);
      info.tok_max = std::max(info.tok_max, tok[i]);
      if (!doc.empty()) {
        info.doc_min = std::min(info.doc_min, doc[i]);
        info.doc_max = std::max(info.doc_max, doc[i]);
      }
    }
    blocks.push_back(info);
  }
  return blocks;
}

std::string shape_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

BlockwisePath choose_path(const at::Tensor& q, BlockwisePath requested) {
  const bool autocast_bf16 = compat::autocast_enabled(c10::DeviceType::CPU) &&
                             compat::autocast_dtype(c10::DeviceType::CPU) == at::kBFloat16 &&
                             q.scalar_type() == at::kFloat;
  const bool bf16 = q.scalar_type() == at::kBFloat16 || autocast_bf16;
  if (requested != BlockwisePath::automatic) {
    MLACP_REQUIRE(path_supported(requested), kWhat, "the requested code path needs CPU features this machine lacks",
                  {got("path", path_name(requested))}, "use BlockwisePath::automatic");
    const bool ok = q.scalar_type() == at::kDouble ? requested == BlockwisePath::float64_portable
                                                   : requested != BlockwisePath::float64_portable &&
                                                         (bf16 || requested != BlockwisePath::bf16_avx512);
    MLACP_REQUIRE(ok, kWhat, "the requested code path does not compute this dtype",
                  {got("path", path_name(requested)), got("dtype", c10::toString(q.scalar_type())),
                   got("bf16_autocast", autocast_bf16)},
                  "float64 runs float64_portable; bf16_avx512 needs bf16 inputs or bf16 autocast");
    return requested;
  }
  if (q.scalar_type() == at::kDouble) return BlockwisePath::float64_portable;
  if (bf16 && cpu_has_avx512_bf16()) return BlockwisePath::bf16_avx512;
  return cpu_has_avx512() ? BlockwisePath::float32_avx512 : BlockwisePath::float32_portable;
}

// The one boundary: device → dtype → layout → shapes → cross-argument rules → options.
std::shared_ptr<const Plan> make_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                                      const AttentionStructure& st, const BlockwiseOptions& opt) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    MLACP_REQUIRE(t->defined() && t->device().is_cpu(), kWhat, "q, k and v must be defined CPU tensors",
                  {got(std::string(name) + ".device", t->defined() ? t->device().str() : "undefined")},
                  "move them to the CPU (this kernel is CPU-only)");
  }
  const at::ScalarType dtype = q.scalar_type();
  MLACP_REQUIRE(dtype == at::kDouble || dtype == at::kFloat || dtype == at::kBFloat16, kWhat,
                "q must be float64, float32 or bfloat16", {got("q.dtype", c10::toString(dtype))},
                "cast the inputs (bf16 via autocast or bf16 tensors)");
  MLACP_REQUIRE(k.scalar_type() == dtype && v.scalar_type() == dtype, kWhat, "q, k and v must share one dtype",
                {got("q.dtype", c10::toString(dtype)), got("k.dtype", c10::toString(k.scalar_type())),
                 got("v.dtype", c10::toString(v.scalar_type()))},
                "cast them to one dtype");
  MLACP_REQUIRE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, kWhat, "q, k, v must be [B,H,S,D]",
                {got("q.shape", shape_of(q)), got("k.shape", shape_of(k)), got("v.shape", shape_of(v))},
                "transpose [B,S,H,D] inputs with .transpose(1, 2)");
  MLACP_REQUIRE(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                    v.size(1) == q.size(1) && v.size(2) == k.size(2) && k.size(3) == q.size(3),
                kWhat, "shapes must be q [B,H,Sq,Dqk], k [B,H,Sk,Dqk], v [B,H,Sk,Dv]",
                {got("q.shape", shape_of(q)), got("k.shape", shape_of(k)), got("v.shape", shape_of(v))},
                "check batch, heads, key length and Dqk");
  const at::Tensor& qi = st.query_token_index;
  const at::Tensor& ki = st.key_token_index;
  MLACP_REQUIRE(qi.defined() && ki.defined() && qi.dim() == 1 && ki.dim() == 1 && qi.size(0) == q.size(2) &&
                    ki.size(0) == k.size(2),
                kWhat, "query_token_index must be [Sq] and key_token_index [Sk]",
                {got("query_token_index.shape", shape_of(qi)), got("key_token_index.shape", shape_of(ki)),
                 got("Sq", q.size(2)), got("Sk", k.size(2))},
                "give every query and key row its global token index");
  if (st.mask.defined()) {
    const at::Tensor& m = st.mask;
    MLACP_REQUIRE(m.scalar_type() == at::kBool && m.dim() == 4 && (m.size(0) == 1 || m.size(0) == q.size(0)) &&
                      m.size(1) == 1 && m.size(2) == q.size(2) && m.size(3) == k.size(2),
                  kWhat, "mask must be bool [B|1, 1, Sq, Sk]",
                  {got("mask.shape", shape_of(m)), got("mask.dtype", c10::toString(m.scalar_type())),
                   got("B", q.size(0)), got("Sq", q.size(2)), got("Sk", k.size(2))},
                  "build it with allowed_pairs-like broadcasting");
  }
  MLACP_REQUIRE(std::isfinite(scaling) && scaling > 0, kWhat, "scaling must be finite and positive",
                {got("scaling", scaling)}, "use 1/sqrt(Dqk) or the model's softmax scale");
  const int64_t block_q = opt.block_q > 0 ? opt.block_q : kDefaultBlockQ;
  const int64_t block_k = opt.block_k > 0 ? opt.block_k : kDefaultBlockK;
  MLACP_REQUIRE(opt.block_q >= 0 && opt.block_k >= 0 && block_q <= kMaxBlock && block_k <= kMaxBlock, kWhat,
                "block sizes must be in [1, " + std::to_string(kMaxBlock) + "] (0 = default)",
                {got("block_q", opt.block_q), got("block_k", opt.block_k)}, "use 0 for the defaults");

  auto plan = std::make_shared<Plan>();
  Plan& p = *plan;
  p.batch = q.size(0), p.heads = q.size(1), p.sq = q.size(2), p.sk = k.size(2), p.dqk = q.size(3), p.dv = v.size(3);
  p.block_q = block_q, p.block_k = block_k;
  p.scaling = scaling;
  p.causal = st.causal;
  p.in_dtype = dtype;
  p.acc_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  p.path = choose_path(q, opt.path);
  p.q_tok = index_vector(qi);
  p.k_tok = index_vector(ki);
  if (st.document_ends.defined() && st.document_ends.numel() > 0) {
    const std::vector<int64_t> ends = index_vector(st.document_ends);
    MLACP_REQUIRE(std::is_sorted(ends.begin(), ends.end()), kWhat, "document_ends must be non-decreasing",
                  {got("document_ends", ends)}, "pass global exclusive ends in order");
    auto doc_of = [&](const std::vector<int64_t>& tok) {
      std::vector<int64_t> doc(tok.size());
      for (size_t i = 0; i < tok.size(); ++i)
        doc[i] = std::upper_bound(ends.begin(), ends.end(), tok[i]) - ends.begin();
      return doc;
    };
    p.has_docs = true;
    p.q_doc = doc_of(p.q_tok);
    p.k_doc = doc_of(p.k_tok);
  }
  p.q_blocks = make_blocks(p.q_tok, p.q_doc, block_q);
  p.k_blocks = make_blocks(p.k_tok, p.k_doc, block_k);
  p.nqb = static_cast<int64_t>(p.q_blocks.size());
  p.nkb = static_cast<int64_t>(p.k_blocks.size());
  if (st.mask.defined()) {
    p.mask = st.mask.view(at::kByte);  // bool and uint8 share a byte layout
    p.mask_data = p.mask.data_ptr<uint8_t>();
    p.mask_sb = p.mask.size(0) == 1 ? 0 : p.mask.stride(0);
    p.mask_si = p.mask.stride(2);
    p.mask_sj = p.mask.stride(3);
  }
  return plan;
}

// Inner dim must be dense; other strides are read in place.
at::Tensor dense_rows(const at::Tensor& t) { return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous(); }

// An output [B,H,S,D] in the memory layout of `like` when that is [B,H,S,D] or [B,S,H,D].
at::Tensor empty_rows_like(const at::Tensor& like, int64_t d, at::ScalarType dtype) {
  const int64_t b = like.size(0), h = like.size(1), s = like.size(2);
  const auto opts = like.options().dtype(dtype);
  if (!like.is_contiguous() && like.transpose(1, 2).is_contiguous())
    return at::empty({b, s, h, d}, opts).transpose(1, 2);
  return at::empty({b, h, s, d}, opts);
}

// ---------------------------------------------------------------------------------------------
// Element conversions.
template <class Dst, class Src>
inline Dst convert_elem(Src x) {
  if constexpr (std::is_same_v<Src, c10::BFloat16>) return static_cast<Dst>(static_cast<float>(x));
  else return static_cast<Dst>(x);
}

#if MLACP_X86
MLACP_AVX512BF16 void f32_to_bf16_avx512(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
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
      if constexpr (std::is_same_v<P, Bf16Avx512>) {
        f32_to_bf16_avx512(reinterpret_cast<const float*>(src), n, dst);
        break;
      }
#endif
      for (int64_t i = 0; i < n; ++i) dst[i] = convert_elem<E>(reinterpret_cast<const float*>(src)[i]);
      break;
    default:
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
  if (src.dtype == scalar_type_of<E>() && pairs_ok) return {reinterpret_cast<const E*>(src.row(b, h, s0)), src.ss};
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
int64_t panel_elems(int64_t k, int64_t n) { return round_up(k, 2) * round_up(n, kNR); }

#if MLACP_X86
alignas(64) const uint16_t kInterleave16[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

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
      if constexpr (!P::kPairs) {
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
          o[p * w + c] = c < nw ? src[p] : E(0);
        } else {
          o[(p * w + c) * 2] = c < nw ? src[2 * p] : E(0);
          o[(p * w + c) * 2 + 1] = c < nw && 2 * p + 1 < k ? src[2 * p + 1] : E(0);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
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
#endif

// C[M × N] (=|+=) A[M × K] · B (panels). Columns [N, n_store) of C are written too (zeros
// from B's padding) so score tiles have finite padding lanes; n_store ≤ round_up(N, 16).
template <class P>
void gemm(int64_t m, int64_t n, int64_t k, const typename P::E* a, int64_t rs, int64_t cs, const typename P::E* b,
          typename P::Acc* c, int64_t ldc, bool accumulate, int64_t n_store = 0) {
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

// ---------------------------------------------------------------------------------------------
// Element-wise tile work. Tiles are S^T [rows = keys][ld = padded query lanes].
#if MLACP_X86
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

// Two f32 rows -> 16 bf16 pairs (row0 low, row1 high).
MLACP_AVX512BF16 inline __m512i pair_rows(__m512 row0, __m512 row1) {
  const __m512bh packed = _mm512_cvtne2ps_pbh(row1, row0);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave16), reinterpret_cast<const __m512i&>(packed));
}

MLACP_AVX512BF16 void store_bf16(c10::BFloat16* dst, __m512 x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(h));
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

// ---------------------------------------------------------------------------------------------
// Per-worker buffers, carved from one byte tensor (counted by the memory probe). The layout
// function runs twice: once to size, once to place.
class Bump {
 public:
  explicit Bump(char* base) : base_(base) {}
  template <class T>
  T* take(int64_t count) {
    offset_ = round_up(offset_, 64);
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += std::max<int64_t>(count, 1) * static_cast<int64_t>(sizeof(T));
    return p;
  }
  int64_t bytes() const { return offset_; }

 private:
  char* base_;
  int64_t offset_ = 0;
};

enum class Phase { forward, backward };

template <class P>
struct Buffers {
  using E = typename P::E;
  using Acc = typename P::Acc;
  at::Tensor storage;
  E *q_rows = nullptr, *k_rows = nullptr, *v_rows = nullptr, *do_rows = nullptr;  // converted rows
  E *q_t = nullptr, *do_t = nullptr, *v_panel = nullptr;                          // B panels
  E *k_panel = nullptr, *q_panel = nullptr, *do_panel = nullptr;
  Acc *st = nullptr, *dpt = nullptr;                // score tiles S^T, dP^T [block_k][ldq]
  E *pw = nullptr, *pt = nullptr, *dst = nullptr;   // bf16 P / dS layouts (pair paths)
  Acc *o_acc = nullptr, *dq_acc = nullptr;          // [block_q][Dv], [block_q][Dqk]
  Acc *m = nullptr, *l = nullptr, *alpha = nullptr, *safe = nullptr, *sum = nullptr;  // per query lane
  Acc *lse = nullptr, *delta = nullptr;
  Acc *dk_head = nullptr, *dv_head = nullptr;       // [Sk][Dqk], [Sk][Dv] (backward, head mode)

  void carve(const Plan& p, Phase phase, bool head_acc, Bump& bump) {
    const int64_t bq = p.block_q, bk = p.block_k, ldq = round_up(bq, kLanes);
    const int64_t dqk2 = round_up(p.dqk, 2), dv2 = round_up(p.dv, 2);
    const int64_t pair_tile = P::kPairs ? round_up(bk, 2) * ldq : 0;
    q_rows = bump.take<E>(bq * dqk2);
    k_rows = bump.take<E>(bk * dqk2);
    v_rows = bump.take<E>(bk * dv2);
    q_t = bump.take<E>(panel_elems(p.dqk, bq));
    st = bump.take<Acc>(bk * ldq);
    pw = bump.take<E>(pair_tile);
    for (Acc** lane : {&m, &l, &alpha, &safe, &sum, &lse, &delta}) *lane = bump.take<Acc>(ldq);
    if (phase == Phase::forward) {
      v_panel = bump.take<E>(panel_elems(bk, p.dv));
      o_acc = bump.take<Acc>(bq * p.dv);
      return;
    }
    do_rows = bump.take<E>(bq * dv2);
    do_t = bump.take<E>(panel_elems(p.dv, bq));
    k_panel = bump.take<E>(panel_elems(bk, p.dqk));
    q_panel = bump.take<E>(panel_elems(bq, p.dqk));
    do_panel = bump.take<E>(panel_elems(bq, p.dv));
    dpt = bump.take<Acc>(bk * ldq);
    pt = bump.take<E>(pair_tile);
    dst = bump.take<E>(pair_tile);
    dq_acc = bump.take<Acc>(bq * p.dqk);
    if (head_acc) {
      dk_head = bump.take<Acc>(p.sk * p.dqk);
      dv_head = bump.take<Acc>(p.sk * p.dv);
    }
  }
  static Buffers make(const Plan& p, Phase phase, bool head_acc) {
    Buffers b;
    Bump sizing(nullptr);
    b.carve(p, phase, head_acc, sizing);
    b.storage = at::empty({sizing.bytes() + 64}, at::TensorOptions().dtype(at::kByte));
    char* base = static_cast<char*>(b.storage.data_ptr());
    Bump placing(base + (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64);
    b.carve(p, phase, head_acc, placing);
    return b;
  }
};

struct Counts {
  int64_t computed = 0, masked = 0;
};

// ---------------------------------------------------------------------------------------------
// Forward: one task = (batch·head, query block).
struct ForwardIO {
  Rows4 q, k, v, out;
  void* lse;  // Acc [B·H·Sq]
};

template <class P>
struct ForwardState {
  Buffers<P> buf;
  Counts counts;
};

template <class P>
void forward_tile_row(const Plan& p, const ForwardIO& io, int64_t bh, int64_t qb, ForwardState<P>& state) {
  using E = typename P::E;
  using Acc = typename P::Acc;
  Buffers<P>& s = state.buf;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const BlockInfo& qi = p.q_blocks[qb];
  const int64_t bq = qi.size, ldq = round_up(bq, kLanes), dqk = p.dqk, dv = p.dv;
  const Acc scale = static_cast<Acc>(p.scaling);
  pack_b_cols<P>(rows_as<P>(io.q, b, h, qi.begin, bq, dqk, s.q_rows, false), bq, dqk, s.q_t);
  std::fill(s.m, s.m + ldq, -std::numeric_limits<Acc>::infinity());
  std::fill(s.l, s.l + ldq, Acc(0));
  std::fill(s.o_acc, s.o_acc + bq * dv, Acc(0));
  const int64_t ua = P::kPairs ? 2 : 1;  // E per A unit along K
  for (int64_t kb = 0; kb < p.nkb; ++kb) {
    const TileKind kind = p.classify(qb, kb);
    if (kind == TileKind::skip || (kind == TileKind::masked && !p.mask_any(b, qb, kb))) continue;
    const BlockInfo& kj = p.k_blocks[kb];
    const int64_t bk = kj.size;
    ++state.counts.computed;
    const RowsE<E> kr = rows_as<P>(io.k, b, h, kj.begin, bk, dqk, s.k_rows, true);
    gemm<P>(bk, bq, dqk, kr.ptr, kr.ld, ua, s.q_t, s.st, ldq, false, ldq);  // S^T = K_j·Q_i^T
    if (kind == TileKind::masked) {
      ++state.counts.masked;
      p.apply_mask(b, qb, kb, s.st, ldq);
    }
    const E* pa;  // P as the A operand of P·V_j: element (i, key) at pa[i·rs + key·cs]
    int64_t rs, cs;
    if constexpr (P::kAvx && P::kPairs) {
#if MLACP_X86
      softmax_step_bf16(bk, ldq, s.st, scale, s.m, s.l, s.alpha, s.pw);
#endif
      pa = s.pw, rs = 2, cs = 2 * ldq;
    } else {
      if constexpr (P::kAvx) {
#if MLACP_X86
        softmax_step_f32(bk, ldq, s.st, scale, s.m, s.l, s.alpha);
#endif
      } else {
        softmax_step_portable<Acc>(bk, ldq, s.st, scale, s.m, s.l, s.alpha, s.safe, s.sum);
      }
      pa = s.st, rs = 1, cs = ldq;
    }
    for (int64_t i = 0; i < bq; ++i) {
      const Acc a = s.alpha[i];
      if (a != Acc(1))
        for (int64_t d = 0; d < dv; ++d) s.o_acc[i * dv + d] *= a;
    }
    pack_b_rows<P>(rows_as<P>(io.v, b, h, kj.begin, bk, dv, s.v_rows, false), bk, dv, s.v_panel);
    gemm<P>(bq, dv, bk, pa, rs, cs, s.v_panel, s.o_acc, dv, true);  // O += P·V_j
  }
  Acc* lse = static_cast<Acc*>(io.lse) + bh * p.sq + qi.begin;
  for (int64_t i = 0; i < bq; ++i) {
    const Acc l = s.l[i];
    store_row<Acc>(s.o_acc + i * dv, dv, l > 0 ? Acc(1) / l : Acc(0), io.out.row(b, h, qi.begin + i), p.in_dtype);
    lse[i] = l > 0 ? s.m[i] + std::log(l) : -std::numeric_limits<Acc>::infinity();
  }
}

template <class P>
void run_forward(const Plan& p, const ForwardIO& io, BlockwiseStats* stats) {
  std::vector<int64_t> cost(p.batch * p.heads * p.nqb);
  for (int64_t qb = 0; qb < p.nqb; ++qb) {
    int64_t c = 1;
    for (int64_t kb = 0; kb < p.nkb; ++kb) c += p.classify(qb, kb) != TileKind::skip;
    for (int64_t bh = 0; bh < p.batch * p.heads; ++bh) cost[bh * p.nqb + qb] = c;
  }
  std::atomic<int64_t> computed{0}, masked{0};
  run_tasks<ForwardState<P>>(
      order_by_cost(cost), [&](int64_t) { return ForwardState<P>{Buffers<P>::make(p, Phase::forward, false), {}}; },
      [&](int64_t t, ForwardState<P>& s) { forward_tile_row<P>(p, io, t / p.nqb, t % p.nqb, s); },
      [&](ForwardState<P>& s) {
        computed += s.counts.computed;
        masked += s.counts.masked;
      });
  if (stats) {
    stats->forward_blocks_computed = computed;
    stats->forward_blocks_masked = masked;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: one task = (batch·head, group g of query blocks g, g+G, ...). dQ_i is local to a
// query block; dK/dV accumulate over the task's query blocks into `dk`/`dv` targets:
//   direct   G = 1, accumulator dtype = gradient dtype: straight into the gradient tensors
//   head     G = 1, bf16 gradients: a per-worker float32 [Sk, D] head buffer, flushed per task
//   partial  G > 1 (few heads, many threads): float32/64 [B·H, G, Sk, D] partials, summed after
enum class AccMode { direct, head, partial };

struct BackwardIO {
  Rows4 q, k, v, dout, dq, dk, dv;
  const void* lse;    // Acc [B·H·Sq]
  const void* delta;  // Acc [B·H·Sq]
  AccMode mode;
  int64_t groups;
  void* dk_part;  // Acc [B·H·G·Sk·Dqk] (partial mode)
  void* dv_part;
};

template <class P>
struct BackwardState {
  Buffers<P> buf;
  Counts counts;
};

template <class P>
void backward_task(const Plan& p, const BackwardIO& io, int64_t bh, int64_t g, BackwardState<P>& state) {
  using E = typename P::E;
  using Acc = typename P::Acc;
  Buffers<P>& s = state.buf;
  const int64_t b = bh / p.heads, h = bh % p.heads, dqk = p.dqk, dv = p.dv;
  const Acc scale = static_cast<Acc>(p.scaling);
  const int64_t ua = P::kPairs ? 2 : 1;
  Acc *dk_base, *dv_base;
  int64_t dk_ld = dqk, dv_ld = dv;
  if (io.mode == AccMode::direct) {
    dk_base = reinterpret_cast<Acc*>(io.dk.row(b, h, 0)), dk_ld = io.dk.ss;
    dv_base = reinterpret_cast<Acc*>(io.dv.row(b, h, 0)), dv_ld = io.dv.ss;
  } else if (io.mode == AccMode::head) {
    dk_base = s.dk_head, dv_base = s.dv_head;
  } else {
    dk_base = static_cast<Acc*>(io.dk_part) + (bh * io.groups + g) * p.sk * dqk;
    dv_base = static_cast<Acc*>(io.dv_part) + (bh * io.groups + g) * p.sk * dv;
  }
  for (int64_t j = 0; j < p.sk; ++j) {
    std::fill(dk_base + j * dk_ld, dk_base + j * dk_ld + dqk, Acc(0));
    std::fill(dv_base + j * dv_ld, dv_base + j * dv_ld + dv, Acc(0));
  }
  const Acc* lse_all = static_cast<const Acc*>(io.lse) + bh * p.sq;
  const Acc* delta_all = static_cast<const Acc*>(io.delta) + bh * p.sq;
  for (int64_t qb = g; qb < p.nqb; qb += io.groups) {
    const BlockInfo& qi = p.q_blocks[qb];
    const int64_t bq = qi.size, ldq = round_up(bq, kLanes);
    const RowsE<E> qr = rows_as<P>(io.q, b, h, qi.begin, bq, dqk, s.q_rows, false);
    const RowsE<E> dor = rows_as<P>(io.dout, b, h, qi.begin, bq, dv, s.do_rows, false);
    pack_b_cols<P>(qr, bq, dqk, s.q_t);       // Q_i^T  [Dqk, bq]
    pack_b_cols<P>(dor, bq, dv, s.do_t);      // dO_i^T [Dv, bq]
    pack_b_rows<P>(qr, bq, dqk, s.q_panel);   // Q_i    [bq, Dqk]
    pack_b_rows<P>(dor, bq, dv, s.do_panel);  // dO_i   [bq, Dv]
    for (int64_t i = 0; i < ldq; ++i) {
      // Rows without keys have lse = −inf: +inf makes every P exactly 0. Padding lanes: 0.
      const Acc l = i < bq ? lse_all[qi.begin + i] : Acc(0);
      s.lse[i] = l == -std::numeric_limits<Acc>::infinity() ? std::numeric_limits<Acc>::infinity() : l;
      s.delta[i] = i < bq ? delta_all[qi.begin + i] : Acc(0);
    }
    std::fill(s.dq_acc, s.dq_acc + bq * dqk, Acc(0));
    for (int64_t kb = 0; kb < p.nkb; ++kb) {
      const TileKind kind = p.classify(qb, kb);
      if (kind == TileKind::skip || (kind == TileKind::masked && !p.mask_any(b, qb, kb))) continue;
      const BlockInfo& kj = p.k_blocks[kb];
      const int64_t bk = kj.size;
      ++state.counts.computed;
      const RowsE<E> kr = rows_as<P>(io.k, b, h, kj.begin, bk, dqk, s.k_rows, true);
      const RowsE<E> vr = rows_as<P>(io.v, b, h, kj.begin, bk, dv, s.v_rows, true);
      gemm<P>(bk, bq, dqk, kr.ptr, kr.ld, ua, s.q_t, s.st, ldq, false, ldq);   // S^T  = K_j·Q_i^T
      if (kind == TileKind::masked) p.apply_mask(b, qb, kb, s.st, ldq);
      gemm<P>(bk, bq, dv, vr.ptr, vr.ld, ua, s.do_t, s.dpt, ldq, false, ldq);  // dP^T = V_j·dO_i^T
      const E *pt_a, *dst_a, *ds_a;  // P^T rows, dS^T rows, dS (query, key)
      int64_t row_rs, ds_rs, ds_cs;
      if constexpr (P::kAvx && P::kPairs) {
#if MLACP_X86
        backward_step_bf16(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta, s.pt, s.dst, s.pw);
#endif
        pt_a = s.pt, dst_a = s.dst, row_rs = ldq, ds_a = s.pw, ds_rs = 2, ds_cs = 2 * ldq;
      } else {
        if constexpr (P::kAvx) {
#if MLACP_X86
          backward_step_f32(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta);
#endif
        } else {
          backward_step_portable<Acc>(bk, ldq, s.st, s.dpt, scale, s.lse, s.delta);
        }
        pt_a = s.st, dst_a = s.dpt, row_rs = ldq, ds_a = s.dpt, ds_rs = 1, ds_cs = ldq;
      }
      gemm<P>(bk, dv, bq, pt_a, row_rs, ua, s.do_panel, dv_base + kj.begin * dv_ld, dv_ld, true);   // dV_j += P^T·dO_i
      gemm<P>(bk, dqk, bq, dst_a, row_rs, ua, s.q_panel, dk_base + kj.begin * dk_ld, dk_ld, true);  // dK_j += dS^T·Q_i
      pack_b_rows<P>(kr, bk, dqk, s.k_panel);
      gemm<P>(bq, dqk, bk, ds_a, ds_rs, ds_cs, s.k_panel, s.dq_acc, dqk, true);  // dQ_i += dS·K_j
    }
    for (int64_t i = 0; i < bq; ++i)
      store_row<Acc>(s.dq_acc + i * dqk, dqk, Acc(1), io.dq.row(b, h, qi.begin + i), p.in_dtype);
  }
  if (io.mode == AccMode::head) {
    for (int64_t j = 0; j < p.sk; ++j) {
      store_row<Acc>(dk_base + j * dqk, dqk, Acc(1), io.dk.row(b, h, j), p.in_dtype);
      store_row<Acc>(dv_base + j * dv, dv, Acc(1), io.dv.row(b, h, j), p.in_dtype);
    }
  }
}

// delta[bh, i] = Σ_d dO·O − dlse (accumulator precision).
template <class Acc>
void compute_delta(const Plan& p, const Rows4& out, const Rows4& dout, const at::Tensor& dlse, Acc* delta) {
  const Acc* dl = dlse.defined() ? dlse.data_ptr<Acc>() : nullptr;
  std::vector<int64_t> order(p.batch * p.heads);
  std::iota(order.begin(), order.end(), 0);
  run_tasks<std::vector<Acc>>(
      order, [&](int64_t) { return std::vector<Acc>(2 * p.dv); },
      [&](int64_t bh, std::vector<Acc>& rows) {
        const int64_t b = bh / p.heads, h = bh % p.heads;
        for (int64_t i = 0; i < p.sq; ++i) {
          load_row_acc(out.row(b, h, i), out.dtype, p.dv, rows.data());
          load_row_acc(dout.row(b, h, i), dout.dtype, p.dv, rows.data() + p.dv);
          Acc sum = 0;
          for (int64_t d = 0; d < p.dv; ++d) sum += rows[d] * rows[p.dv + d];
          delta[bh * p.sq + i] = sum - (dl ? dl[bh * p.sq + i] : Acc(0));
        }
      },
      [](std::vector<Acc>&) {});
}

template <class P>
void run_backward(const Plan& p, const BackwardIO& io, BlockwiseStats* stats) {
  const int64_t bh_count = p.batch * p.heads;
  std::vector<int64_t> cost(bh_count * io.groups);
  for (int64_t g = 0; g < io.groups; ++g) {
    int64_t c = 1;
    for (int64_t qb = g; qb < p.nqb; qb += io.groups)
      for (int64_t kb = 0; kb < p.nkb; ++kb) c += p.classify(qb, kb) != TileKind::skip;
    for (int64_t bh = 0; bh < bh_count; ++bh) cost[bh * io.groups + g] = c;
  }
  std::atomic<int64_t> computed{0};
  run_tasks<BackwardState<P>>(
      order_by_cost(cost),
      [&](int64_t) { return BackwardState<P>{Buffers<P>::make(p, Phase::backward, io.mode == AccMode::head), {}}; },
      [&](int64_t t, BackwardState<P>& s) { backward_task<P>(p, io, t / io.groups, t % io.groups, s); },
      [&](BackwardState<P>& s) { computed += s.counts.computed; });
  if (stats) stats->backward_blocks_computed = computed;
}

// ---------------------------------------------------------------------------------------------
// Entry points.
template <class Fn>
void dispatch_path(BlockwisePath path, Fn&& fn) {
  switch (path) {
    case BlockwisePath::float64_portable: return fn(F64Portable{});
    case BlockwisePath::float32_portable: return fn(F32Portable{});
#if MLACP_X86
    case BlockwisePath::float32_avx512: return fn(F32Avx512{});
    case BlockwisePath::bf16_avx512: return fn(Bf16Avx512{});
#endif
    default: fail(kWhat, "internal: unsupported path", {got("path", path_name(path))}, "report this");
  }
}

BlockwiseResult forward_impl(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             BlockwiseStats* stats) {
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  BlockwiseResult r;
  r.out = empty_rows_like(qd, p.dv, p.in_dtype);
  r.lse = at::empty({p.batch, p.heads, p.sq}, q.options().dtype(p.acc_dtype));
  if (stats) {
    *stats = BlockwiseStats{};
    stats->path = p.path, stats->block_q = p.block_q, stats->block_k = p.block_k;
    stats->blocks_total = p.batch * p.heads * p.nqb * p.nkb;
  }
  if (r.out.numel() == 0 && r.lse.numel() == 0) return r;
  const ForwardIO io{rows_of(qd), rows_of(kd), rows_of(vd), rows_of(r.out), r.lse.data_ptr()};
  dispatch_path(p.path, [&](auto path) { run_forward<decltype(path)>(p, io, stats); });
  return r;
}

BlockwiseGrads backward_impl(const Plan& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                             const at::Tensor& dlse, BlockwiseStats* stats) {
  const at::Tensor qd = dense_rows(q), kd = dense_rows(k), vd = dense_rows(v);
  const at::Tensor od = dense_rows(out), dod = dense_rows(dout);
  const at::Tensor lse_c = lse.contiguous();
  const at::Tensor dlse_c = dlse.defined() ? dlse.to(p.acc_dtype).contiguous() : at::Tensor();
  BlockwiseGrads g{empty_rows_like(qd, p.dqk, p.in_dtype), empty_rows_like(kd, p.dqk, p.in_dtype),
                   empty_rows_like(vd, p.dv, p.in_dtype)};
  if (g.dq.numel() + g.dk.numel() + g.dv.numel() == 0) return g;
  if (p.sq == 0) {  // no queries: no gradient reaches k, v
    g.dk.zero_(), g.dv.zero_();
    return g;
  }
  at::Tensor delta = at::empty({p.batch, p.heads, p.sq}, q.options().dtype(p.acc_dtype));
  BackwardIO io{rows_of(qd),   rows_of(kd),   rows_of(vd),   rows_of(dod), rows_of(g.dq),
                rows_of(g.dk), rows_of(g.dv), lse_c.data_ptr(), delta.data_ptr(), AccMode::direct,
                1,             nullptr,       nullptr};
  if (p.acc_dtype == at::kDouble)
    compute_delta<double>(p, rows_of(od), rows_of(dod), dlse_c, delta.data_ptr<double>());
  else
    compute_delta<float>(p, rows_of(od), rows_of(dod), dlse_c, delta.data_ptr<float>());
  // Query-block groups per head: enough tasks to keep every worker busy (G > 1 only when there
  // are fewer than 2 heads·batches per worker; then dK/dV go through per-group partials).
  const int64_t bh_count = p.batch * p.heads;
  io.groups = std::clamp<int64_t>(ceil_div(2 * worker_count(), std::max<int64_t>(bh_count, 1)), 1,
                                  std::max<int64_t>(p.nqb, 1));
  at::Tensor dk_part, dv_part;
  if (io.groups > 1) {
    io.mode = AccMode::partial;
    dk_part = at::empty({p.batch, p.heads, io.groups, p.sk, p.dqk}, q.options().dtype(p.acc_dtype));
    dv_part = at::empty({p.batch, p.heads, io.groups, p.sk, p.dv}, q.options().dtype(p.acc_dtype));
    io.dk_part = dk_part.data_ptr(), io.dv_part = dv_part.data_ptr();
  } else {
    io.mode = p.acc_dtype == p.in_dtype ? AccMode::direct : AccMode::head;
  }
  dispatch_path(p.path, [&](auto path) { run_backward<decltype(path)>(p, io, stats); });
  if (io.mode == AccMode::partial) {
    g.dk.copy_(dk_part.sum(2));
    g.dv.copy_(dv_part.sum(2));
  }
  return g;
}

void check_backward_args(const Plan& p, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                         const at::Tensor& dlse) {
  const std::vector<int64_t> out_shape{p.batch, p.heads, p.sq, p.dv}, lse_shape{p.batch, p.heads, p.sq};
  MLACP_REQUIRE(out.defined() && dout.defined() && out.sizes().vec() == out_shape && dout.sizes().vec() == out_shape,
                kWhat, "out and dout must be [B,H,Sq,Dv]",
                {got("out.shape", shape_of(out)), got("dout.shape", shape_of(dout)), got("expected", out_shape)},
                "pass the forward's output and its gradient");
  MLACP_REQUIRE(out.scalar_type() == p.in_dtype && dout.scalar_type() == p.in_dtype, kWhat,
                "out and dout must have the inputs' dtype",
                {got("out.dtype", c10::toString(out.scalar_type())),
                 got("dout.dtype", c10::toString(dout.scalar_type())), got("q.dtype", c10::toString(p.in_dtype))},
                "cast dout to the output dtype");
  MLACP_REQUIRE(
      lse.defined() && lse.sizes().vec() == lse_shape && lse.scalar_type() == p.acc_dtype, kWhat,
      "lse must be the forward's log-sum-exp [B,H,Sq] (float32; float64 for float64 inputs)",
      {got("lse.shape", shape_of(lse)), got("lse.dtype", lse.defined() ? c10::toString(lse.scalar_type()) : "-")},
      "pass BlockwiseResult::lse");
  MLACP_REQUIRE(!dlse.defined() || dlse.sizes().vec() == lse_shape, kWhat, "dlse must be [B,H,Sq] or undefined",
                {got("dlse.shape", shape_of(dlse))}, "pass the gradient of lse or nothing");
}

BlockwiseResult forward_with_graph(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                                   const AttentionStructure& st, const BlockwiseOptions& opt, bool with_lse) {
  std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, st, opt);
  BlockwiseResult r = forward_impl(*plan, q, k, v, opt.stats);
  std::vector<at::Tensor> outputs{r.out};
  if (with_lse) outputs.push_back(r.lse);
  // Saved as plain aliases (no autograd identity, so no reference cycle through the node); their
  // version counters catch in-place changes between forward and backward.
  std::vector<at::Tensor> saved{q.detach(), k.detach(), v.detach(), r.out};
  std::vector<int64_t> versions;
  for (const at::Tensor& t : saved) versions.push_back(static_cast<int64_t>(t._version()));
  BackwardFn backward = [plan, saved, versions, lse = r.lse, stats = opt.stats,
                         with_lse](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
    static const char* const kNames[] = {"q", "k", "v", "out"};
    for (size_t i = 0; i < saved.size(); ++i) {
      MLACP_REQUIRE(static_cast<int64_t>(saved[i]._version()) == versions[i], kWhat,
                    "a tensor saved for backward was modified in place after the forward",
                    {got("tensor", kNames[i]), got("version_at_forward", versions[i]),
                     got("version_now", static_cast<int64_t>(saved[i]._version()))},
                    "modify a clone instead");
    }
    const at::Tensor& out = saved[3];
    const at::Tensor dout = grads[0].scalar_type() == out.scalar_type() ? grads[0] : grads[0].to(out.scalar_type());
    const at::Tensor dlse = with_lse ? grads[1] : at::Tensor();
    BlockwiseGrads g = backward_impl(*plan, saved[0], saved[1], saved[2], out, lse, dout, dlse, stats);
    return {g.dq, g.dk, g.dv};
  };
  outputs = attach_backward({q, k, v}, std::move(outputs), "BlockwiseAttentionBackward", std::move(backward));
  return {outputs[0], with_lse ? outputs[1] : r.lse};
}

}  // namespace

std::string path_name(BlockwisePath path) {
  switch (path) {
    case BlockwisePath::automatic: return "automatic";
    case BlockwisePath::float64_portable: return "float64_portable";
    case BlockwisePath::float32_portable: return "float32_portable";
    case BlockwisePath::float32_avx512: return "float32_avx512";
    case BlockwisePath::bf16_avx512: return "bf16_avx512";
  }
  return "unknown";
}

bool path_supported(BlockwisePath path) {
  switch (path) {
    case BlockwisePath::float32_avx512: return cpu_has_avx512();
    case BlockwisePath::bf16_avx512: return cpu_has_avx512_bf16();
    default: return true;
  }
}

at::Tensor blockwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               const AttentionStructure& structure, const BlockwiseOptions& options) {
  return forward_with_graph(q, k, v, scaling, structure, options, false).out;
}

BlockwiseResult blockwise_attention_with_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             double scaling, const AttentionStructure& structure,
                                             const BlockwiseOptions& options) {
  return forward_with_graph(q, k, v, scaling, structure, options, true);
}

BlockwiseResult blockwise_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double scaling, const AttentionStructure& structure,
                                            const BlockwiseOptions& options) {
  const std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, structure, options);
  return forward_impl(*plan, q.detach(), k.detach(), v.detach(), options.stats);
}

BlockwiseGrads blockwise_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                            const at::Tensor& dlse, double scaling,
                                            const AttentionStructure& structure, const BlockwiseOptions& options) {
  const std::shared_ptr<const Plan> plan = make_plan(q, k, v, scaling, structure, options);
  check_backward_args(*plan, out, lse, dout, dlse);
  return backward_impl(*plan, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout.detach(),
                       dlse.defined() ? dlse.detach() : dlse, options.stats);
}

}  // namespace mlacp
