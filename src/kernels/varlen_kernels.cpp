// The two VarlenKernels of kernels/piece_attention.h: plain ATen math per piece (any device, the
// oracle of the planning) and LibTorch's memory-efficient CUDA attention (PyTorch 2.x builds).
#include <cstdlib>
#include <limits>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "core/compat.h"
#include "core/device.h"
#include "kernels/piece_attention.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "varlen attention kernel";
constexpr double kInf = std::numeric_limits<double>::infinity();

at::ScalarType math_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// [T, H, D] rows -> [H, T, D] in the math dtype
at::Tensor heads_first(const at::Tensor& rows) { return rows.to(math_type(rows.scalar_type())).permute({1, 0, 2}); }

// Scores of one piece [H, m, n] with the bottom-right causal mask applied when `causal`.
at::Tensor piece_scores(const at::Tensor& q, const at::Tensor& k, double scaling, bool causal) {
  at::Tensor s = at::matmul(q, k.transpose(1, 2)) * scaling;
  if (causal) {
    const int64_t m = s.size(1), n = s.size(2);
    s = s.masked_fill(at::ones({m, n}, s.options().dtype(at::kBool)).triu(n - m + 1), -kInf);
  }
  return s;
}

// Softmax probabilities from scores and the (final) log-sum-exp; 0 where the score is −inf.
at::Tensor probabilities(const at::Tensor& s, const at::Tensor& lse) {
  at::Tensor p = at::exp(s - lse.unsqueeze(-1));
  return at::where(at::isnan(p), at::zeros_like(p), p);  // −inf − (−inf) in a row with no key
}

// The flash-attention backward of one block given P: q [H,m,D], k [H,n,D], v [H,n,Dv], o/dout [H,m,Dv].
PieceGrads block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& p,
                          const at::Tensor& o, const at::Tensor& dout, double scaling) {
  at::Tensor dv = at::matmul(p.transpose(-1, -2), dout);
  at::Tensor dp = at::matmul(dout, v.transpose(-1, -2));
  at::Tensor ds = p * (dp - (dout * o).sum(-1, /*keepdim=*/true));
  return {at::matmul(ds, k) * scaling, at::matmul(ds.transpose(-1, -2), q) * scaling, dv};
}

class ReferenceVarlenKernel final : public VarlenKernel {
 public:
  std::string name() const override { return "reference (ATen math per piece)"; }

  PieceResult forward(const VarlenCall& c) const override {
    const PieceGroup& g = *c.group;
    const int64_t tq = c.q.size(0), h = c.q.size(1), dv = c.v.size(2);
    PieceResult r{at::empty({tq, h, dv}, c.q.options()), at::empty({tq, h}, c.q.options().dtype(math_type(c.q.scalar_type())))};
    for (int64_t p = 0; p < g.pieces(); ++p) {
      const int64_t q0 = g.cu_query[p], m = g.cu_query[p + 1] - q0, k0 = g.cu_key[p], n = g.cu_key[p + 1] - k0;
      at::Tensor s = piece_scores(heads_first(c.q.narrow(0, q0, m)), heads_first(c.k.narrow(0, k0, n)), c.scaling, g.causal);
      at::Tensor lse = at::logsumexp(s, -1);  // [H, m]
      at::Tensor o = at::matmul(probabilities(s, lse), heads_first(c.v.narrow(0, k0, n)));
      r.out.narrow(0, q0, m).copy_(o.permute({1, 0, 2}));
      r.lse.narrow(0, q0, m).copy_(lse.t());
    }
    return r;
  }

  PieceGrads backward(const VarlenCall& c, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                      const std::vector<at::Tensor>&) const override {
    const PieceGroup& g = *c.group;
    const at::ScalarType t = math_type(c.q.scalar_type());
    PieceGrads r{at::zeros(c.q.sizes(), c.q.options().dtype(t)), at::zeros(c.k.sizes(), c.k.options().dtype(t)),
                 at::zeros(c.v.sizes(), c.v.options().dtype(t))};
    for (int64_t p = 0; p < g.pieces(); ++p) {
      const int64_t q0 = g.cu_query[p], m = g.cu_query[p + 1] - q0, k0 = g.cu_key[p], n = g.cu_key[p + 1] - k0;
      const at::Tensor q = heads_first(c.q.narrow(0, q0, m)), k = heads_first(c.k.narrow(0, k0, n)),
                       v = heads_first(c.v.narrow(0, k0, n));
      at::Tensor prob = probabilities(piece_scores(q, k, c.scaling, g.causal), lse.narrow(0, q0, m).to(t).t());
      PieceGrads b = block_backward(q, k, v, prob, heads_first(out.narrow(0, q0, m)), heads_first(dout.narrow(0, q0, m)),
                                    c.scaling);
      r.dq.narrow(0, q0, m).add_(b.dq.permute({1, 0, 2}));
      r.dk.narrow(0, k0, n).add_(b.dk.permute({1, 0, 2}));
      r.dv.narrow(0, k0, n).add_(b.dv.permute({1, 0, 2}));
    }
    return r;
  }

  // [B, S, H, D] -> [B, H, S, D] in the math dtype
  static at::Tensor dense_heads(const at::Tensor& x) { return x.to(math_type(x.scalar_type())).transpose(1, 2); }

  PieceResult dense_forward(const DenseCall& c) const override {
    at::Tensor s = at::matmul(dense_heads(c.q), dense_heads(c.k).transpose(-1, -2)) * c.scaling + c.bias.to(math_type(c.q.scalar_type()));
    at::Tensor lse = at::logsumexp(s, -1);  // [B, H, Sq]
    at::Tensor o = at::matmul(probabilities(s, lse), dense_heads(c.v));
    return {o.transpose(1, 2).to(c.q.scalar_type()), lse.transpose(1, 2)};
  }

  PieceGrads dense_backward(const DenseCall& c, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                            const std::vector<at::Tensor>&) const override {
    const at::ScalarType t = math_type(c.q.scalar_type());
    const at::Tensor q = dense_heads(c.q), k = dense_heads(c.k), v = dense_heads(c.v);
    at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * c.scaling + c.bias.to(t);
    PieceGrads b = block_backward(q, k, v, probabilities(s, lse.to(t).transpose(1, 2)), dense_heads(out),
                                  dense_heads(dout), c.scaling);
    return {b.dq.transpose(1, 2), b.dk.transpose(1, 2), b.dv.transpose(1, 2)};
  }
};

#if MLACP_TORCH_2
// Shared by the CUDA kernels (written against the operator schemas of PyTorch 2.x; NOT YET RUN ON
// A GPU: README "Status").

// A head dim padded to a multiple of 8 with zeros: the fused kernels' alignment. Zero columns add
// nothing to q·k and produce zero output columns, which are cut off again.
int64_t aligned(int64_t d) { return (d + 7) / 8 * 8; }
at::Tensor pad_last(const at::Tensor& x, int64_t width) {
  if (x.size(-1) == width) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = width;
  at::Tensor out = at::zeros(shape, x.options());
  out.narrow(-1, 0, x.size(-1)).copy_(x);
  return out;
}

at::Tensor cu_lengths(const std::vector<int64_t>& v, const c10::Device& device) {
  return host_to_device(at::tensor(v, at::kLong).to(at::kInt), device);
}

// The packed row of each (piece, row in piece) slot of a [pieces, H, width] log-sum-exp: piece p's
// rows sit at p * width + i.
at::Tensor lse_slots(const PieceGroup& g, int64_t width, const c10::Device& device) {
  std::vector<int64_t> slot;
  slot.reserve(g.cu_query.back());
  for (int64_t p = 0; p < g.pieces(); ++p)
    for (int64_t i = 0; i < g.cu_query[p + 1] - g.cu_query[p]; ++i) slot.push_back(p * width + i);
  return host_to_device(at::tensor(slot, at::kLong), device);
}
// [pieces, H, width] -> [T, H] rows
at::Tensor lse_rows_from_padded(const PieceGroup& g, const at::Tensor& lse) {
  const int64_t width = lse.size(2), h = lse.size(1);
  return lse.transpose(1, 2).reshape({g.pieces() * width, h}).index_select(0, lse_slots(g, width, lse.device()));
}
// [T, H] rows -> [pieces, H, width] (float32, zeros in the unused slots)
at::Tensor lse_padded_from_rows(const PieceGroup& g, const at::Tensor& rows, int64_t width) {
  const int64_t h = rows.size(1);
  at::Tensor packed = at::zeros({g.pieces() * width, h}, rows.options().dtype(at::kFloat));
  packed.index_copy_(0, lse_slots(g, width, rows.device()), rows.to(at::kFloat));
  return packed.view({g.pieces(), width, h}).transpose(1, 2).contiguous();
}

// LibTorch's memory-efficient attention (CUTLASS; the kernel of SDPA's EFFICIENT_ATTENTION
// backend): Dqk != Dv allowed; q/k/v [1, T, H, D] packed with cu_seqlens (int32, on the device);
// custom_mask_type 0 = none, 2 = causal aligned to the bottom right; log-sum-exp
// [pieces, H, ceil(longest/32)*32] float32. Deterministic backward under
// at::globalContext().deterministicAlgorithms() (LibTorch's own choice of key splits).
class MemoryEfficientKernel final : public VarlenKernel {
 public:
  std::string name() const override { return "memory-efficient (LibTorch CUTLASS, varlen)"; }

  static int64_t mask_type(const PieceGroup& g) { return g.causal ? 2 : 0; }

  PieceResult forward(const VarlenCall& c) const override {
    const PieceGroup& g = *c.group;
    const c10::Device device = c.q.device();
    const int64_t dqk = aligned(c.q.size(-1)), dv = aligned(c.v.size(-1));
    auto r = at::_efficient_attention_forward(
        pad_last(c.q, dqk).unsqueeze(0), pad_last(c.k, dqk).unsqueeze(0), pad_last(c.v, dv).unsqueeze(0),
        std::nullopt, cu_lengths(g.cu_query, device), cu_lengths(g.cu_key, device), g.max_query, g.max_key,
        /*dropout_p=*/0.0, mask_type(g), /*compute_log_sumexp=*/true, c.scaling);
    at::Tensor out = std::get<0>(r).squeeze(0).narrow(-1, 0, c.v.size(-1));  // [T, H, Dv]
    // state: the philox seed and offset (unused scalars without dropout), handed to the backward
    return {out, lse_rows_from_padded(g, std::get<1>(r)), {std::get<2>(r), std::get<3>(r)}};
  }

  PieceGrads backward(const VarlenCall& c, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                      const std::vector<at::Tensor>& state) const override {
    const PieceGroup& g = *c.group;
    const c10::Device device = c.q.device();
    const int64_t dqk = aligned(c.q.size(-1)), dv = aligned(c.v.size(-1));
    const at::Tensor packed_lse = lse_padded_from_rows(g, lse, (g.max_query + 31) / 32 * 32);
    auto r = at::_efficient_attention_backward(
        pad_last(dout.contiguous(), dv).unsqueeze(0), pad_last(c.q, dqk).unsqueeze(0), pad_last(c.k, dqk).unsqueeze(0),
        pad_last(c.v, dv).unsqueeze(0), std::nullopt, pad_last(out.contiguous(), dv).unsqueeze(0),
        cu_lengths(g.cu_query, device), cu_lengths(g.cu_key, device), g.max_query, g.max_key, packed_lse,
        /*dropout_p=*/0.0, state.at(0), state.at(1), mask_type(g), /*bias_requires_grad=*/false, c.scaling);
    return {std::get<0>(r).squeeze(0).narrow(-1, 0, c.q.size(-1)), std::get<1>(r).squeeze(0).narrow(-1, 0, c.k.size(-1)),
            std::get<2>(r).squeeze(0).narrow(-1, 0, c.v.size(-1))};
  }

  // The bias with its rows 16-element aligned (the kernel's requirement), broadcast over heads.
  static at::Tensor aligned_bias(const DenseCall& c) {
    const int64_t sk = c.bias.size(3), padded = (sk + 15) / 16 * 16;
    at::Tensor b = at::empty({c.bias.size(0), 1, c.bias.size(2), padded}, c.bias.options()).narrow(3, 0, sk);
    b.copy_(c.bias);
    return b.expand({c.q.size(0), c.q.size(2), c.bias.size(2), sk});
  }

  PieceResult dense_forward(const DenseCall& c) const override {
    const int64_t dqk = aligned(c.q.size(-1)), dv = aligned(c.v.size(-1));
    auto r = at::_efficient_attention_forward(pad_last(c.q, dqk), pad_last(c.k, dqk), pad_last(c.v, dv),
                                              aligned_bias(c), std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                              0.0, 0, true, c.scaling);
    const int64_t sq = c.q.size(1);
    return {std::get<0>(r).narrow(-1, 0, c.v.size(-1)), std::get<1>(r).narrow(2, 0, sq).transpose(1, 2),  // lse [B, Sq, H]
            {std::get<2>(r), std::get<3>(r)}};
  }

  PieceGrads dense_backward(const DenseCall& c, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                            const std::vector<at::Tensor>& state) const override {
    const int64_t dqk = aligned(c.q.size(-1)), dv = aligned(c.v.size(-1));
    const int64_t sq = c.q.size(1), width = (sq + 31) / 32 * 32;
    at::Tensor packed = at::zeros({c.q.size(0), c.q.size(2), width}, lse.options().dtype(at::kFloat));
    packed.narrow(2, 0, sq).copy_(lse.transpose(1, 2));
    auto r = at::_efficient_attention_backward(pad_last(dout.contiguous(), dv), pad_last(c.q, dqk), pad_last(c.k, dqk),
                                               pad_last(c.v, dv), aligned_bias(c), pad_last(out.contiguous(), dv),
                                               std::nullopt, std::nullopt, sq, c.k.size(1), packed, 0.0,
                                               state.at(0), state.at(1), 0, false, c.scaling);
    return {std::get<0>(r).narrow(-1, 0, c.q.size(-1)), std::get<1>(r).narrow(-1, 0, c.k.size(-1)),
            std::get<2>(r).narrow(-1, 0, c.v.size(-1))};
  }
};

// LibTorch's flash attention (varlen, causal aligned to the bottom right) with V zero-padded to
// Dqk: its kernels take one head dim for q, k and v, so MLA's Dv = 128 < Dqk = 192 costs the
// padded columns' FLOPs (1.2x for DeepSeek-V3's dims). 16-bit only; the dense masked path is the
// memory-efficient kernel's. The varlen log-sum-exp is [H, T] in PyTorch 2.x (an older
// [pieces, H, width] layout is read too, from its shape). Deterministic backward under
// at::globalContext().deterministicAlgorithms().
class FlashPaddedKernel final : public VarlenKernel {
 public:
  std::string name() const override { return "flash (LibTorch, varlen, V padded to Dqk)"; }

  static at::Tensor lse_rows(const PieceGroup& g, const at::Tensor& lse) {
    if (lse.dim() == 2) return lse.t();  // [H, T] -> [T, H]
    return lse_rows_from_padded(g, lse);
  }

  PieceResult forward(const VarlenCall& c) const override {
    const PieceGroup& g = *c.group;
    const c10::Device device = c.q.device();
    const int64_t d = aligned(c.q.size(-1));
    auto r = at::_flash_attention_forward(pad_last(c.q, d), pad_last(c.k, d), pad_last(c.v, d),
                                          cu_lengths(g.cu_query, device), cu_lengths(g.cu_key, device), g.max_query,
                                          g.max_key, /*dropout_p=*/0.0, /*is_causal=*/g.causal,
                                          /*return_debug_mask=*/false, c.scaling);
    const at::Tensor& lse = std::get<1>(r);
    // state: the random-number state and its companion (unused without dropout, passed back as
    // the kernel made them) and the log-sum-exp's layout (host metadata: its shape)
    return {std::get<0>(r).narrow(-1, 0, c.v.size(-1)), lse_rows(g, lse),
            {std::get<2>(r), std::get<3>(r), at::tensor(lse.sizes().vec(), at::kLong)}};
  }

  PieceGrads backward(const VarlenCall& c, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                      const std::vector<at::Tensor>& state) const override {
    const PieceGroup& g = *c.group;
    const c10::Device device = c.q.device();
    const int64_t d = aligned(c.q.size(-1));
    const at::Tensor& shape = state.at(2);  // the forward's log-sum-exp shape, on the host
    const at::Tensor kernel_lse = shape.numel() == 2 ? lse.to(at::kFloat).t().contiguous()
                                                     : lse_padded_from_rows(g, lse, shape.data_ptr<int64_t>()[2]);
    auto r = at::_flash_attention_backward(pad_last(dout.contiguous(), d), pad_last(c.q, d), pad_last(c.k, d),
                                           pad_last(c.v, d), pad_last(out.contiguous(), d), kernel_lse,
                                           cu_lengths(g.cu_query, device), cu_lengths(g.cu_key, device), g.max_query,
                                           g.max_key, /*dropout_p=*/0.0, g.causal, state.at(0), state.at(1), c.scaling);
    return {std::get<0>(r).narrow(-1, 0, c.q.size(-1)), std::get<1>(r).narrow(-1, 0, c.k.size(-1)),
            std::get<2>(r).narrow(-1, 0, c.v.size(-1))};
  }

  PieceResult dense_forward(const DenseCall& c) const override { return masked_.dense_forward(c); }
  PieceGrads dense_backward(const DenseCall& c, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                            const std::vector<at::Tensor>& state) const override {
    return masked_.dense_backward(c, out, lse, dout, state);
  }

 private:
  MemoryEfficientKernel masked_;
};
#endif

}  // namespace

const VarlenKernel& reference_varlen_kernel() {
  static const ReferenceVarlenKernel kernel;
  return kernel;
}

const VarlenKernel* memory_efficient_varlen_kernel() {
#if MLACP_TORCH_2
  static const MemoryEfficientKernel kernel;
  return &kernel;
#else
  return nullptr;
#endif
}

const VarlenKernel* flash_padded_varlen_kernel() {
#if MLACP_TORCH_2
  static const FlashPaddedKernel kernel;
  return &kernel;
#else
  return nullptr;
#endif
}

std::string cuda_attention_setting() {
  const char* value = std::getenv("MLACP_CUDA_ATTENTION");
  const std::string setting = value && *value ? value : "auto";
  MLACP_REQUIRE(setting == "auto" || setting == "efficient" || setting == "flash", kWhat,
                "MLACP_CUDA_ATTENTION must be auto, efficient or flash", {got("MLACP_CUDA_ATTENTION", setting)},
                "unset it (auto: flash with V padded for 16-bit pieces, the memory-efficient kernel for float32), "
                "or set efficient (the memory-efficient kernel for every dtype) or flash");
  return setting;
}

const VarlenKernel& varlen_kernel_for(const c10::Device& device, at::ScalarType dtype) {
  // The fused kernels have no float64: float64 on a GPU (the exactness checks) takes the reference.
  if (!device.is_cuda() || dtype == at::kDouble) return reference_varlen_kernel();
  // 16-bit pieces take flash with V padded unless the memory-efficient kernel is asked for: on an
  // H200 (LibTorch 2.11, causal, 16 heads, Dqk 192, Dv 128, S = 8K-64K) flash ran forward+backward
  // 3.8-4.6x faster (docs/DESIGN.md §16). Flash has no float32.
  const bool flash = cuda_attention_setting() != "efficient" && dtype != at::kFloat;
  const VarlenKernel* kernel = flash ? flash_padded_varlen_kernel() : memory_efficient_varlen_kernel();
  MLACP_REQUIRE(kernel != nullptr, kWhat, "CUDA tensors need LibTorch's fused attention kernels (PyTorch 2.x)",
                {got("device", device)}, "build mlacp against the LibTorch of a PyTorch 2.x CUDA wheel");
  return *kernel;
}

}  // namespace mlacp
