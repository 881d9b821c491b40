// SegmentedAttention (rows computed at different times, one autograd node) and the blockwise
// "into" entry points it is built on: equal to one blockwise call over all rows, on every code
// path and accumulation mode, and its contract is enforced.
#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "core/compat.h"
#include "kernels/blockwise_attention.h"
#include "kernels/segmented_attention.h"
#include "mlacp/errors.h"
#include "support/error_of.h"

namespace mlacp {
namespace {

struct Shape {
  int64_t batch = 2, heads = 3, sq = 41, sk = 57, dqk = 12, dv = 7;
};

// Queries: a head_tail-like subset of the keys' tokens (so rows start at different causal
// depths), documents crossing segment borders, a random mask with one dead row.
AttentionStructure structure_for(const Shape& s, bool with_mask) {
  AttentionStructure st;
  st.causal = true;
  std::vector<int64_t> q;
  for (int64_t t = 0; t < s.sq; ++t) q.push_back(t < s.sq / 2 ? t : s.sk - s.sq + t);
  st.query_token_index = at::tensor(q, at::kLong);
  st.key_token_index = at::arange(s.sk, at::kLong);
  st.document_ends = at::tensor(std::vector<int64_t>{9, 30, s.sk}, at::kLong);
  if (with_mask) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/3);
    st.mask = at::rand({s.batch, 1, s.sq, s.sk}, gen, at::kDouble) < 0.8;
    st.mask.select(2, 17).fill_(false);
  }
  return st;
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// q/k/v in [B,S,H,D] memory viewed as [B,H,S,D], as the CP runtime passes them.
struct Inputs {
  at::Tensor q, k, v, dout;
};
Inputs make_inputs(const Shape& s, at::ScalarType dtype) {
  at::manual_seed(11);
  auto bshd = [&](int64_t rows, int64_t d) {
    return at::randn({s.batch, rows, s.heads, d}, at::kDouble).to(dtype).transpose(1, 2);
  };
  return {bshd(s.sq, s.dqk), bshd(s.sk, s.dqk), bshd(s.sk, s.dv), bshd(s.sq, s.dv)};
}

template <class Fn>
Result run(const Inputs& in, Fn attention) {
  at::Tensor q = in.q.detach().requires_grad_(true), k = in.k.detach().requires_grad_(true),
             v = in.v.detach().requires_grad_(true);
  at::Tensor out = attention(q, k, v);
  out.backward(in.dout);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}
double rel_max(const at::Tensor& a, const at::Tensor& ref) {
  return max_abs(a, ref) / std::max(ref.to(at::kDouble).abs().max().item<double>(), 1e-300);
}

// Rows [early_begin, early_end) computed first, the rest (before and after) by finish().
Result segmented(const Shape& s, const Inputs& in, const AttentionStructure& st, int64_t early_begin,
                 int64_t early_end, const BlockwiseOptions& opt) {
  const double scaling = 1.0 / std::sqrt(static_cast<double>(s.dqk));
  return run(in, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    SegmentedAttention a(k, v, scaling, st, s.sq, opt);
    a.compute_rows(q.detach().narrow(2, early_begin, early_end - early_begin).clone(), early_begin);
    return a.finish(q, k, v);
  });
}

Result single(const Shape& s, const Inputs& in, const AttentionStructure& st, const BlockwiseOptions& opt) {
  const double scaling = 1.0 / std::sqrt(static_cast<double>(s.dqk));
  return run(in, [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return blockwise_attention(q, k, v, scaling, st, opt);
  });
}

void expect_close(const Result& a, const Result& b, double out_tol, double grad_tol, const std::string& what) {
  EXPECT_LE(rel_max(a.out, b.out), out_tol) << what << " out";
  EXPECT_LE(rel_max(a.dq, b.dq), grad_tol) << what << " dq";
  EXPECT_LE(rel_max(a.dk, b.dk), grad_tol) << what << " dk";
  EXPECT_LE(rel_max(a.dv, b.dv), grad_tol) << what << " dv";
}

TEST(SegmentedAttention, Float64EqualsOneCallForAnySplit) {
  const Shape s;
  for (bool mask : {false, true}) {
    const AttentionStructure st = structure_for(s, mask);
    const Inputs in = make_inputs(s, at::kDouble);
    BlockwiseOptions opt;
    opt.block_q = 8, opt.block_k = 5;
    const Result ref = single(s, in, st, opt);
    // early rows at the start, in the middle (two gaps), at the end, everything, nothing.
    for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 20}, {13, 29}, {30, 41}, {0, 41}, {7, 7}}) {
      const Result r = segmented(s, in, st, b, e, opt);
      expect_close(r, ref, 1e-14, 1e-13, "mask=" + std::to_string(mask) + " rows " + std::to_string(b) + ".." +
                                             std::to_string(e));
      EXPECT_TRUE(r.dq.strides() == in.q.strides()) << "dq keeps q's layout";
    }
  }
}

TEST(SegmentedAttention, Float32OutputIsBitwiseOneCallsOnEveryPath) {
  const Shape s;
  const AttentionStructure st = structure_for(s, true);
  const Inputs in = make_inputs(s, at::kFloat);
  std::vector<BlockwisePath> paths{BlockwisePath::float32_portable};
  for (BlockwisePath p : {BlockwisePath::float32_avx512, BlockwisePath::float32_avx2})
    if (path_supported(p)) paths.push_back(p);
  for (BlockwisePath path : paths) {
    BlockwiseOptions opt;
    opt.path = path;
    const Result ref = single(s, in, st, opt), r = segmented(s, in, st, 13, 29, opt);
    EXPECT_EQ(max_abs(r.out, ref.out), 0.0) << path_name(path);  // rows are independent
    EXPECT_EQ(max_abs(r.dq, ref.dq), 0.0) << path_name(path);
    expect_close(r, ref, 0.0, 1e-6, path_name(path));  // dK/dV: two partial sums
  }
  if (path_supported(BlockwisePath::bf16_avx512)) {  // float32 inputs under bf16 autocast
    compat::AutocastGuard autocast(c10::DeviceType::CPU, true, at::kBFloat16);
    const Result ref = single(s, in, st, {}), r = segmented(s, in, st, 13, 29, {});
    EXPECT_EQ(max_abs(r.out, ref.out), 0.0) << "bf16 autocast";
    EXPECT_EQ(max_abs(r.dq, ref.dq), 0.0) << "bf16 autocast";
    expect_close(r, ref, 0.0, 1e-6, "bf16 autocast");
  }
}

TEST(SegmentedAttention, Bf16InputsAccumulateInFloat32Heads) {
  // bf16 gradients go through the per-head float32 buffer ("head" mode), which must start from
  // the target's sum when accumulating.
  const Shape s;
  const AttentionStructure st = structure_for(s, false);
  const Inputs in = make_inputs(s, at::kBFloat16);
  const Result ref = single(s, in, st, {}), r = segmented(s, in, st, 10, 30, {});
  EXPECT_EQ(r.dk.scalar_type(), at::kBFloat16);
  expect_close(r, ref, 0.0, 2e-2, "bf16");  // one extra bf16 rounding of the partial dK/dV
}

TEST(SegmentedAttention, PartialModeAccumulatesWithSeveralThreads) {
  // One batch·head and 2 workers: query-block groups with float32 partials summed after.
  Shape s;
  s.batch = 1, s.heads = 1;
  const AttentionStructure st = structure_for(s, false);
  const Inputs in = make_inputs(s, at::kDouble);
  const int saved = at::get_num_threads();
  at::set_num_threads(2);
  BlockwiseOptions opt;
  opt.block_q = 4, opt.block_k = 8;
  const Result ref = single(s, in, st, opt), r = segmented(s, in, st, 5, 22, opt);
  at::set_num_threads(saved);
  expect_close(r, ref, 1e-14, 1e-13, "partial");
}

TEST(SegmentedAttention, BackwardIntoAddsToTheTargets) {
  const Shape s;
  const AttentionStructure st = structure_for(s, false);
  const Inputs in = make_inputs(s, at::kDouble);
  const double scaling = 0.3;
  BlockwiseResult f = blockwise_attention_forward(in.q, in.k, in.v, scaling, st);
  BlockwiseGrads fresh = blockwise_attention_backward(in.q, in.k, in.v, f.out, f.lse, in.dout, {}, scaling, st);
  BlockwiseGrads into{at::zeros_like(in.q), at::full_like(in.k, 2.0), at::full_like(in.v, -1.0)};
  blockwise_attention_backward_into(in.q, in.k, in.v, f.out, f.lse, in.dout, {}, scaling, st, into, true);
  EXPECT_LE(max_abs(into.dq, fresh.dq), 1e-14);
  EXPECT_LE(max_abs(into.dk, fresh.dk + 2.0), 1e-13);
  EXPECT_LE(max_abs(into.dv, fresh.dv - 1.0), 1e-13);
  blockwise_attention_backward_into(in.q, in.k, in.v, f.out, f.lse, in.dout, {}, scaling, st, into, false);
  EXPECT_LE(max_abs(into.dk, fresh.dk), 1e-14) << "without accumulate the target is overwritten";
  // Forward into a row range of a larger output.
  at::Tensor big = at::zeros({s.batch, s.heads, s.sq + 5, s.dv}, at::kDouble);
  at::Tensor lse = blockwise_attention_forward_into(in.q, in.k, in.v, scaling, st, big.narrow(2, 3, s.sq));
  EXPECT_EQ(max_abs(big.narrow(2, 3, s.sq), f.out), 0.0);
  EXPECT_EQ(max_abs(lse, f.lse), 0.0);
  EXPECT_EQ(big.narrow(2, 0, 3).abs().max().item<double>(), 0.0) << "rows outside the target untouched";
}

TEST(SegmentedAttention, ContractViolationsAreErrors) {
  const Shape s;
  const AttentionStructure st = structure_for(s, false);
  const Inputs in = make_inputs(s, at::kDouble);
  auto message = [](auto&& fn) { return test::error_of(fn); };
  {
    SegmentedAttention a(in.k, in.v, 0.3, st, s.sq);
    a.compute_rows(in.q.narrow(2, 0, 10), 0);
    EXPECT_NE(message([&] { a.compute_rows(in.q.narrow(2, 5, 10), 5); }).find("must not overlap"), std::string::npos);
    EXPECT_NE(message([&] { a.compute_rows(in.q.narrow(2, 0, 10), 35); }).find("inside [0, Sq)"), std::string::npos);
    EXPECT_NE(message([&] { a.finish(in.q, in.k.clone(), in.v); }).find("constructor's k and v"), std::string::npos);
    a.finish(in.q, in.k, in.v);
    EXPECT_NE(message([&] { a.finish(in.q, in.k, in.v); }).find("twice"), std::string::npos);
  }
  EXPECT_NE(message([&] { SegmentedAttention(in.k, in.v, 0.3, st, s.sq + 1); }).find("every query row"),
            std::string::npos);
  at::Tensor wrong = at::zeros({s.batch, s.heads, s.sq, s.dv + 1}, at::kDouble);
  EXPECT_NE(message([&] { blockwise_attention_forward_into(in.q, in.k, in.v, 0.3, st, wrong); })
                .find("output target must have the result's shape"),
            std::string::npos);
}

}  // namespace
}  // namespace mlacp
