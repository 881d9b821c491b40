#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "kernels/reference_attention.h"

namespace mlacp {
namespace {

at::Tensor range(int64_t n) { return at::arange(n, at::kLong); }

AttentionStructure full(int64_t s, bool causal) {
  AttentionStructure st;
  st.causal = causal;
  st.query_token_index = range(s);
  st.key_token_index = range(s);
  return st;
}

TEST(ReferenceAttention, MatchesHandComputedSoftmax) {
  // One query, two keys: weights softmax([1*2, 1*0]) * scaling 0.5 = softmax([1, 0]).
  at::Tensor q = at::tensor({1.0}, at::kDouble).view({1, 1, 1, 1});
  at::Tensor k = at::tensor({2.0, 0.0}, at::kDouble).view({1, 1, 2, 1});
  at::Tensor v = at::tensor({10.0, 20.0}, at::kDouble).view({1, 1, 2, 1});
  AttentionStructure st = full(2, false);
  st.query_token_index = at::tensor({1}, at::kLong);
  const double e = std::exp(1.0);
  const double expected = (10.0 * e + 20.0) / (e + 1.0);
  EXPECT_NEAR(reference_attention(q, k, v, 0.5, st).item<double>(), expected, 1e-14);
}

TEST(ReferenceAttention, QueryRowsWithGlobalIndicesEqualRowsOfTheFullComputation) {
  at::manual_seed(0);
  const int64_t s = 12;
  at::Tensor q = at::randn({2, 3, s, 5}, at::kDouble), k = at::randn({2, 3, s, 5}, at::kDouble);
  at::Tensor v = at::randn({2, 3, s, 4}, at::kDouble);
  for (bool causal : {true, false}) {
    AttentionStructure st = full(s, causal);
    st.document_ends = at::tensor({4, 9, 12}, at::kLong);
    at::Tensor all = reference_attention(q, k, v, 0.3, st);
    at::Tensor rows = at::tensor({0, 3, 4, 8, 11}, at::kLong);  // a non-contiguous (head_tail-like) slice
    st.query_token_index = rows;
    at::Tensor some = reference_attention(q.index_select(2, rows), k, v, 0.3, st);
    EXPECT_LT((some - all.index_select(2, rows)).abs().max().item<double>(), 1e-15) << "causal=" << causal;
  }
}

TEST(ReferenceAttention, DocumentsAndCausalityAreRespected) {
  AttentionStructure st = full(6, true);
  st.document_ends = at::tensor({2, 6}, at::kLong);
  at::Tensor allowed = allowed_pairs(st).view({6, 6});
  EXPECT_TRUE(allowed[1][0].item<bool>());
  EXPECT_FALSE(allowed[0][1].item<bool>());  // causal
  EXPECT_FALSE(allowed[2][1].item<bool>());  // other document
  EXPECT_TRUE(allowed[5][2].item<bool>());
  EXPECT_EQ(allowed.sum().item<int64_t>(), 3 + 10);
}

TEST(ReferenceAttention, FullyMaskedRowGivesZeroOutputAndZeroGradientNotNaN) {
  at::manual_seed(1);
  at::Tensor q = at::randn({1, 2, 4, 3}, at::kDouble).requires_grad_(true);
  at::Tensor k = at::randn({1, 2, 4, 3}, at::kDouble).requires_grad_(true);
  at::Tensor v = at::randn({1, 2, 4, 2}, at::kDouble).requires_grad_(true);
  AttentionStructure st = full(4, false);
  st.mask = at::ones({1, 1, 4, 4}, at::kBool);
  st.mask.select(2, 2).fill_(false);  // query row 2 sees nothing
  at::Tensor out = reference_attention(q, k, v, 0.5, st);
  out.sum().backward();
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  EXPECT_EQ(out.select(2, 2).abs().max().item<double>(), 0.0);
  EXPECT_EQ(q.grad().select(2, 2).abs().max().item<double>(), 0.0);
  EXPECT_TRUE(k.grad().isfinite().all().item<bool>());
  EXPECT_TRUE(v.grad().isfinite().all().item<bool>());
  EXPECT_GT(q.grad().select(2, 1).abs().max().item<double>(), 0.0);
}

}  // namespace
}  // namespace mlacp
