// The piece path of CUDA tensors (kernels/attention_pieces.h, kernels/piece_attention.h), checked on
// the CPU: the pieces cover exactly the allowed pairs for random structures, and the planning, the
// gathers, the log-sum-exp combination and the backward with the final statistics, run through the
// reference varlen kernel, equal the naive reference in float64 (output and dQ, dK, dV) for every
// structure the runtime makes: causal / full, packed documents crossing shards, head_tail shards,
// Ulysses blocks, key subsets and gaps, reversed keys, masks with rows that see nothing.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/compat.h"
#include "kernels/attend.h"
#include "kernels/attention_pieces.h"
#include "kernels/piece_attention.h"
#include "kernels/reference_attention.h"
#include "mlacp/errors.h"
#include "support/attention_structures.h"
#include "support/error_of.h"

namespace mlacp {
namespace {

using test::AttentionCase;
using test::Mask;
using test::range;
using test::structure_of;
using Case = AttentionCase;
std::vector<Case> cases() { return test::attention_cases(); }

struct Result {
  at::Tensor out, dq, dk, dv;
};

template <typename Attention>
Result run(const Case& c, at::ScalarType dtype, Attention attention) {
  const int64_t sq = static_cast<int64_t>(c.q_tokens.size()), sk = static_cast<int64_t>(c.k_tokens.size());
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/5);
  auto draw = [&](int64_t s, int64_t d) {
    // [B,S,H,D] memory seen as [B,H,S,D], as the runtime holds its tensors
    return at::randn({c.batch, s, c.heads, d}, gen, at::kDouble).to(dtype).transpose(1, 2).requires_grad_(true);
  };
  at::Tensor q = draw(sq, c.dqk), k = draw(sk, c.dqk), v = draw(sk, c.dv);
  at::Tensor w = at::randn({c.batch, c.heads, sq, c.dv}, gen, at::kDouble).to(dtype);
  at::Tensor out = attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(c.dqk)));
  (out * w).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

double max_error(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(PieceAttention, Float64EqualsTheReferenceForEveryStructure) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const AttentionStructure st = structure_of(c);
    PieceStats stats;
    Result got = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) {
      return piece_attention(q, k, v, s, st, &reference_varlen_kernel(), &stats);
    });
    Result want = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) { return reference_attention(q, k, v, s, st); });
    EXPECT_LT(max_error(got.out, want.out), 1e-12);
    EXPECT_LT(max_error(got.dq, want.dq), 1e-12);
    EXPECT_LT(max_error(got.dk, want.dk), 1e-12);
    EXPECT_LT(max_error(got.dv, want.dv), 1e-12);
    EXPECT_EQ(stats.masked, c.mask != Mask::none);
    EXPECT_EQ(stats.kernel, reference_varlen_kernel().name());
    // Output and gradients keep the runtime's [B,S,H,D] memory layout.
    EXPECT_TRUE(got.out.transpose(1, 2).is_contiguous());
    EXPECT_TRUE(got.dq.transpose(1, 2).is_contiguous());
  }
}

TEST(PieceAttention, Float32AndBf16StayWithinTheReferenceBounds) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const AttentionStructure st = structure_of(c);
    Result want = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) { return reference_attention(q, k, v, s, st); });
    for (auto [dtype, bound] : {std::pair{at::kFloat, 1e-5}, std::pair{at::kBFloat16, 5e-2}}) {
      Result got = run(c, dtype, [&](auto& q, auto& k, auto& v, double s) {
        return piece_attention(q, k, v, s, st, &reference_varlen_kernel());
      });
      EXPECT_EQ(got.out.scalar_type(), dtype);
      EXPECT_EQ(got.dq.scalar_type(), dtype);
      EXPECT_LT(max_error(got.out, want.out), bound) << c10::toString(dtype);
      EXPECT_LT(max_error(got.dk, want.dk), 4 * bound) << c10::toString(dtype);
    }
  }
}

TEST(PieceAttention, RowsWithoutKeysGiveExactZeros) {
  for (const std::string name : {"key_subset", "mask_dead_rows_docs"}) {
    const std::vector<Case> all = cases();
    const Case c = *std::find_if(all.begin(), all.end(), [&](const Case& x) { return x.name == name; });
    const AttentionStructure st = structure_of(c);
    Result got = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) {
      return piece_attention(q, k, v, s, st, &reference_varlen_kernel());
    });
    at::Tensor dead = allowed_pairs(st).any(-1).logical_not().squeeze(1);  // [B|1, Sq]
    ASSERT_GT(dead.sum().item<int64_t>(), 0);
    at::Tensor dead_rows = dead.unsqueeze(1).unsqueeze(-1).expand_as(got.out);
    EXPECT_EQ(got.out.masked_select(dead_rows).abs().max().item<double>(), 0.0) << name;
    EXPECT_EQ(got.dq.masked_select(dead_rows.narrow(3, 0, 1).expand_as(got.dq)).abs().max().item<double>(), 0.0) << name;
  }
}

// The reference kernel, except that a dense call whose bias forbids every key of some row answers
// with NaN (that row's output, and every gradient): what LibTorch's fused kernels did with such rows
// in bf16 on an H200 (scripts/gpu-check.sh). The masked path must never hand a kernel such a row.
class PoisonedByDeadRows final : public VarlenKernel {
 public:
  std::string name() const override { return "reference, NaN for fully masked rows"; }
  PieceResult forward(const VarlenCall& call) const override { return reference_varlen_kernel().forward(call); }
  PieceGrads backward(const VarlenCall& call, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                      const std::vector<at::Tensor>& state) const override {
    return reference_varlen_kernel().backward(call, out, lse, dout, state);
  }
  PieceResult dense_forward(const DenseCall& call) const override {
    PieceResult r = reference_varlen_kernel().dense_forward(call);
    const at::Tensor dead = dead_rows(call);  // [B|1, Sq]
    r.out = r.out.masked_fill(dead.unsqueeze(-1).unsqueeze(-1).expand_as(r.out), NAN);
    return r;
  }
  PieceGrads dense_backward(const DenseCall& call, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                            const std::vector<at::Tensor>& state) const override {
    PieceGrads g = reference_varlen_kernel().dense_backward(call, out, lse, dout, state);
    if (dead_rows(call).any().item<bool>()) g.dq.fill_(NAN), g.dk.fill_(NAN), g.dv.fill_(NAN);
    return g;
  }
  mutable int64_t dead_rows_seen = 0;

 private:
  at::Tensor dead_rows(const DenseCall& call) const {
    const at::Tensor dead = (call.bias < -1000).all(-1).squeeze(1);
    dead_rows_seen += dead.sum().item<int64_t>();
    return dead;
  }
};

TEST(PieceAttention, NoKernelCallSeesARowMaskedEntirely) {
  const std::vector<Case> all = cases();
  const Case c = *std::find_if(all.begin(), all.end(), [](const Case& x) { return x.name == "mask_dead_rows_docs"; });
  const AttentionStructure st = structure_of(c);
  ASSERT_GT(allowed_pairs(st).any(-1).logical_not().sum().item<int64_t>(), 0);
  const PoisonedByDeadRows kernel;
  Result got = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) { return piece_attention(q, k, v, s, st, &kernel); });
  Result want = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) { return reference_attention(q, k, v, s, st); });
  EXPECT_EQ(kernel.dead_rows_seen, 0);
  EXPECT_LT(max_error(got.out, want.out), 1e-12);
  EXPECT_LT(max_error(got.dq, want.dq), 1e-12);
  EXPECT_LT(max_error(got.dk, want.dk), 1e-12);
  EXPECT_LT(max_error(got.dv, want.dv), 1e-12);
}

// Count how often the pieces cover each (query row, key row) pair.
at::Tensor coverage(const PiecePlan& plan) {
  at::Tensor count = at::zeros({plan.query_rows, plan.key_rows}, at::kLong);
  auto a = count.accessor<int64_t, 2>();
  for (const PieceGroup& g : plan.groups) {
    for (int64_t p = 0; p < g.pieces(); ++p) {
      const int64_t q0 = g.cu_query[p], m = g.cu_query[p + 1] - q0, k0 = g.cu_key[p], n = g.cu_key[p + 1] - k0;
      EXPECT_TRUE(m > 0 && n > 0);
      if (g.causal) EXPECT_GE(n, m) << "a causal piece needs at least as many keys as queries (bottom-right)";
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j)
          if (!g.causal || j <= i + n - m) ++a[g.query_rows[q0 + i]][g.key_rows[k0 + j]];
    }
  }
  return count;
}

TEST(AttentionPieces, PiecesCoverExactlyTheAllowedPairsOfRandomStructures) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t length = 1 + static_cast<int64_t>(rng() % 40);
    std::vector<int64_t> tokens = range(0, length), q, k;
    for (int64_t t : tokens) {
      if (rng() % 3 != 0) q.push_back(t);
      if (rng() % 4 != 0) k.push_back(t);
    }
    if (q.empty()) q.push_back(0);
    if (k.empty()) k.push_back(length - 1);
    std::shuffle(q.begin(), q.end(), rng);
    std::shuffle(k.begin(), k.end(), rng);
    AttentionStructure st;
    st.causal = rng() % 2 == 0;
    st.query_token_index = at::tensor(q, at::kLong);
    st.key_token_index = at::tensor(k, at::kLong);
    if (rng() % 2 == 0) {
      std::vector<int64_t> ends;
      for (int64_t t = 1; t < length; ++t)
        if (rng() % 6 == 0) ends.push_back(t);
      ends.push_back(length);
      st.document_ends = at::tensor(ends, at::kLong);
    }
    const PiecePlan plan = plan_pieces(st);
    at::Tensor allowed = allowed_pairs(st).squeeze(0).squeeze(0).to(at::kLong);
    ASSERT_TRUE(at::equal(coverage(plan), allowed)) << "trial " << trial;
    EXPECT_EQ(plan.pairs, allowed.sum().item<int64_t>());
  }
}

TEST(AttentionPieces, ShardsMakeFewPiecesAndGapsNeedTheCombination) {
  auto plan_of = [](const Case& c) { return plan_pieces(structure_of(c)); };
  const std::vector<Case> all = cases();
  auto find = [&](const std::string& n) { return *std::find_if(all.begin(), all.end(), [&](const Case& x) { return x.name == n; }); };
  // head_tail (queries 0..11 | 36..47, documents end at 20 and 48): 2 query segments, 2 key
  // segments (0..19 | 20..47), one causal piece per document, each row once.
  const PiecePlan ht = plan_of(find("head_tail_docs"));
  EXPECT_EQ(ht.query_segments, 2);
  EXPECT_EQ(ht.key_segments, 2);
  ASSERT_EQ(ht.groups.size(), 1u);
  EXPECT_EQ(ht.groups[0].pieces(), 2);
  EXPECT_TRUE(ht.each_row_once);
  const PiecePlan causal = plan_of(find("causal"));
  ASSERT_EQ(causal.groups.size(), 1u);
  EXPECT_EQ(causal.groups[0].pieces(), 1);
  EXPECT_TRUE(causal.groups[0].causal);
  const PiecePlan gap = plan_of(find("key_gap"));
  EXPECT_EQ(gap.key_segments, 2);
  EXPECT_FALSE(gap.each_row_once);
}

TEST(PieceAttention, AttendRoutesThePiecesKernelAndRejectionsNameTheRule) {
  const Case c = cases()[2];
  const AttentionStructure st = structure_of(c);
  Result via_attend = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) {
    return attend(AttentionKernel::pieces, q, k, v, s, st);
  });
  Result want = run(c, at::kDouble, [&](auto& q, auto& k, auto& v, double s) { return reference_attention(q, k, v, s, st); });
  EXPECT_LT(max_error(via_attend.out, want.out), 1e-12);
  EXPECT_EQ(parse_kernel("pieces"), AttentionKernel::pieces);
  EXPECT_EQ(kernel_name(AttentionKernel::pieces), "pieces");
  EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCPU), at::kFloat), &reference_varlen_kernel());
  EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCPU), at::kBFloat16), &reference_varlen_kernel());
  // Float64 has no fused kernel: on a GPU it takes the reference too (no GPU needed to ask).
  EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kDouble), &reference_varlen_kernel());
  EXPECT_EQ(memory_efficient_varlen_kernel() != nullptr, MLACP_TORCH_2 == 1);
  EXPECT_EQ(flash_padded_varlen_kernel() != nullptr, MLACP_TORCH_2 == 1);
  if (MLACP_TORCH_2) {
    // auto (unset): flash for 16-bit pieces, the memory-efficient kernel for float32
    EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kFloat), memory_efficient_varlen_kernel());
    EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kBFloat16), flash_padded_varlen_kernel());
    EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kHalf), flash_padded_varlen_kernel());
    ::setenv("MLACP_CUDA_ATTENTION", "efficient", 1);
    EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kBFloat16), memory_efficient_varlen_kernel());
    ::setenv("MLACP_CUDA_ATTENTION", "flash", 1);
    EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kBFloat16), flash_padded_varlen_kernel());
    EXPECT_EQ(&varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kFloat), memory_efficient_varlen_kernel());
    ::setenv("MLACP_CUDA_ATTENTION", "fast", 1);
    EXPECT_NE(test::error_of([] { varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kBFloat16); }).find("auto, efficient or flash"),
              std::string::npos);
    ::unsetenv("MLACP_CUDA_ATTENTION");
  } else {
    EXPECT_THROW(varlen_kernel_for(c10::Device(c10::kCUDA, 0), at::kFloat), Error);
  }

  AttentionStructure masked = st;
  masked.mask = at::ones({1, 1, 37, 37}, at::kBool);
  EXPECT_THROW(plan_pieces(masked), Error);
  AttentionStructure wrong = st;
  wrong.query_token_index = at::arange(36, at::kLong);
  at::Tensor q = at::randn({1, 2, 37, 12}, at::kDouble), k = at::randn({1, 2, 37, 12}, at::kDouble),
             v = at::randn({1, 2, 37, 7}, at::kDouble);
  try {
    piece_attention(q, k, v, 1.0, wrong);
    ADD_FAILURE() << "a structure that does not describe every row was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("every query and key row"), std::string::npos) << e.what();
  }
  AttentionStructure int32_index = st;
  int32_index.key_token_index = st.key_token_index.to(at::kInt);
  EXPECT_THROW(plan_pieces(int32_index), Error);
}

}  // namespace
}  // namespace mlacp
