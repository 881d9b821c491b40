// Blockwise attention plan: argument checks, code-path choice, block ranges and tile masking;
// also the public path_name / path_supported.
#include "kernels/blockwise_plan.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/compat.h"
#include "kernels/blockwise_gemm.h"
#include "kernels/blockwise_isa.h"
#include "mlacp/errors.h"

namespace mlacp::blockwise_detail {
namespace {

// 128 × 128 tiles: per-worker temporaries ~1 MB (float32, Dqk 192, Dv 128), far below the
// 32 MiB page-fault cliff. Measured at S=2048, 1 thread, fwd+bwd: 64×64 … 256×256 tiles all
// within ±5% (noise) of 128×128 (~97 GFLOP/s float32, ~185 bf16; micro-kernel peak 115 / 230).
constexpr int64_t kDefaultBlockQ = 128;
constexpr int64_t kDefaultBlockK = 128;
constexpr int64_t kMaxBlock = 4096;

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
                                                         (bf16 || (requested != BlockwisePath::bf16_avx512 &&
                                                                   requested != BlockwisePath::bf16_via_f32_avx512 &&
                                                                   requested != BlockwisePath::bf16_via_f32_avx2 &&
                                                                   requested != BlockwisePath::bf16_amx));
    MLACP_REQUIRE(ok, kWhat, "the requested code path does not compute this dtype",
                  {got("path", path_name(requested)), got("dtype", c10::toString(q.scalar_type())),
                   got("bf16_autocast", autocast_bf16)},
                  "float64 runs float64_portable; the bf16 paths need bf16 inputs or bf16 autocast");
    return requested;
  }
  return automatic_path(bf16 ? at::kBFloat16 : q.scalar_type());
}

}  // namespace

template <class Acc>
void Plan::apply_mask(int64_t b, int64_t qb, int64_t kb, Acc* st, int64_t ld) const {
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
template void Plan::apply_mask<float>(int64_t, int64_t, int64_t, float*, int64_t) const;
template void Plan::apply_mask<double>(int64_t, int64_t, int64_t, double*, int64_t) const;

std::string shape_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
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

}  // namespace mlacp::blockwise_detail

namespace mlacp {

using blockwise_detail::cpu_has_avx2_fma;
using blockwise_detail::cpu_has_avx512;
using blockwise_detail::cpu_has_avx512_bf16;
using blockwise_detail::cpu_has_amx_bf16;

std::string path_name(BlockwisePath path) {
  switch (path) {
    case BlockwisePath::automatic: return "automatic";
    case BlockwisePath::float64_portable: return "float64_portable";
    case BlockwisePath::float32_portable: return "float32_portable";
    case BlockwisePath::float32_avx512: return "float32_avx512";
    case BlockwisePath::bf16_avx512: return "bf16_avx512";
    case BlockwisePath::bf16_via_f32_avx512: return "bf16_via_f32_avx512";
    case BlockwisePath::bf16_amx: return "bf16_amx";
    case BlockwisePath::float32_avx2: return "float32_avx2";
    case BlockwisePath::bf16_via_f32_avx2: return "bf16_via_f32_avx2";
  }
  return "unknown";
}

Bf16PathChoice bf16_path_choice() {
  Bf16PathChoice c;
  const bool dot_wins = blockwise_detail::bf16_dot_outruns_f32_fma(&c.dot_gflops, &c.fma_gflops);
  c.amx_gflops = blockwise_detail::amx_bf16_gflops();
  auto rates = [&] {
    auto r = [](double x) { return std::to_string(static_cast<int>(x + 0.5)); };
    return " (micro-kernels on one thread: " + (c.amx_gflops > 0 ? "AMX tiles " + r(c.amx_gflops) + " GFLOP/s, " : "") +
           "bf16 dot product " + r(c.dot_gflops) + " GFLOP/s, float32 FMA " + r(c.fma_gflops) + ")";
  };
  // amx_gflops is 0 without AMX (and so are the other two without AVX-512): never 0 >= 1.25 x 0.
  if (c.amx_gflops > 0 && c.amx_gflops >= 1.25 * std::max(c.dot_gflops, c.fma_gflops)) {
    c.path = BlockwisePath::bf16_amx;
    c.reason = "bf16_amx: AMX tiles outrun this CPU's bf16 dot product and float32 FMAs" + rates();
  } else if (dot_wins) {
    c.path = BlockwisePath::bf16_avx512;
    c.reason = "bf16_avx512: the AVX-512-BF16 dot product outruns float32 FMAs" + rates();
  } else if (cpu_has_avx512()) {
    c.path = BlockwisePath::bf16_via_f32_avx512;
    c.reason = cpu_has_avx512_bf16()
                   ? "bf16_via_f32_avx512: this CPU's bf16 dot product is not faster than its float32 FMAs" + rates()
                   : std::string("bf16_via_f32_avx512: no AVX-512-BF16 on this CPU");
  } else if (cpu_has_avx2_fma()) {
    c.path = BlockwisePath::bf16_via_f32_avx2;
    c.reason = "bf16_via_f32_avx2: no AVX-512 on this CPU; the bf16 values on AVX2 float32 FMAs";
  } else {
    c.reason = "float32_portable: neither AVX-512 nor AVX2 + FMA on this CPU";
  }
  return c;
}

BlockwisePath automatic_path(c10::ScalarType dtype) {
  if (dtype == at::kDouble) return BlockwisePath::float64_portable;
  if (dtype == at::kBFloat16) return bf16_path_choice().path;
  if (cpu_has_avx512()) return BlockwisePath::float32_avx512;
  return cpu_has_avx2_fma() ? BlockwisePath::float32_avx2 : BlockwisePath::float32_portable;
}

bool path_supported(BlockwisePath path) {
  switch (path) {
    case BlockwisePath::float32_avx512: return cpu_has_avx512();
    case BlockwisePath::bf16_avx512: return cpu_has_avx512_bf16();
    case BlockwisePath::bf16_via_f32_avx512: return cpu_has_avx512();
    case BlockwisePath::bf16_amx: return cpu_has_amx_bf16();
    case BlockwisePath::float32_avx2:
    case BlockwisePath::bf16_via_f32_avx2: return cpu_has_avx2_fma();
    default: return true;
  }
}

}  // namespace mlacp
