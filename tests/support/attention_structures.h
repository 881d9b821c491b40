// The attention structures the runtime makes, as small cases shared by the CPU test of the piece
// path (tests/kernels/piece_attention_test.cpp) and the GPU check (tests/gpu/gpu_check.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/reference_attention.h"

namespace mlacp::test {

enum class Mask { none, random, dead_rows };

struct AttentionCase {
  std::string name;
  int64_t batch = 2, heads = 2, dqk = 12, dv = 7;
  bool causal = true;
  std::vector<int64_t> q_tokens, k_tokens, doc_ends;
  Mask mask = Mask::none;
};

inline std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> r;
  for (int64_t i = begin; i < end; ++i) r.push_back(i);
  return r;
}
inline std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline std::vector<AttentionCase> attention_cases() {
  std::vector<AttentionCase> c;
  c.push_back({"causal", 2, 2, 12, 7, true, range(0, 37), range(0, 37)});
  c.push_back({"full", 2, 2, 12, 7, false, range(0, 37), range(0, 37)});
  c.push_back({"docs_causal", 2, 2, 12, 7, true, range(0, 37), range(0, 37), {3, 11, 12, 26, 37}});
  c.push_back({"docs_full", 1, 3, 9, 16, false, range(0, 37), range(0, 37), {7, 20, 37}});
  // head_tail: rank 0 of 2 holds chunks 0 and 3 of 48 tokens; a document crosses the shards.
  c.push_back({"head_tail_docs", 2, 2, 12, 7, true, concat(range(0, 12), range(36, 48)), range(0, 48), {20, 48}});
  // A later CP shard (offset causal): queries 24..35 against all keys before and after them.
  c.push_back({"offset_shard", 1, 2, 12, 7, true, range(24, 36), range(0, 48)});
  // Ulysses after the exchange: rows of every rank's head_tail shard in rank order, keys likewise.
  {
    const std::vector<int64_t> order = concat(concat(range(0, 8), range(24, 32)), concat(range(8, 16), range(16, 24)));
    c.push_back({"ulysses_head_tail_order", 2, 2, 12, 7, true, order, order, {5, 19, 32}});
  }
  c.push_back({"key_subset", 2, 2, 12, 7, true, range(0, 30), range(10, 30)});
  // Keys with a gap: rows past the gap are in two pieces, combined by log-sum-exp.
  c.push_back({"key_gap", 2, 2, 12, 7, true, range(0, 30), concat(range(0, 9), range(15, 30))});
  c.push_back({"key_gap_full", 1, 2, 12, 7, false, range(0, 30), concat(range(2, 9), range(15, 27)), {20, 30}});
  {
    AttentionCase rev{"reversed_keys_strided_queries", 1, 2, 12, 7, true, {}, {}, {17, 40}};
    for (int64_t t = 39; t >= 0; --t) rev.k_tokens.push_back(t);
    for (int64_t t = 1; t < 40; t += 3) rev.q_tokens.push_back(t);
    c.push_back(rev);
  }
  c.push_back({"mask_random", 2, 2, 12, 7, true, range(2, 31), range(0, 31), {}, Mask::random});
  c.push_back({"mask_dead_rows_docs", 2, 2, 12, 7, false, range(0, 37), range(0, 37), {9, 37}, Mask::dead_rows});
  c.push_back({"dqk_equals_dv", 1, 1, 5, 5, false, range(0, 9), range(0, 11)});
  return c;
}

inline AttentionStructure structure_of(const AttentionCase& c) {
  AttentionStructure st;
  st.causal = c.causal;
  st.query_token_index = at::tensor(c.q_tokens, at::kLong);
  st.key_token_index = at::tensor(c.k_tokens, at::kLong);
  if (!c.doc_ends.empty()) st.document_ends = at::tensor(c.doc_ends, at::kLong);
  const int64_t sq = static_cast<int64_t>(c.q_tokens.size()), sk = static_cast<int64_t>(c.k_tokens.size());
  if (c.mask == Mask::random) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/11);
    st.mask = at::rand({c.batch, 1, sq, sk}, gen, at::kDouble) < 0.7;
  } else if (c.mask == Mask::dead_rows) {
    st.mask = at::ones({1, 1, sq, sk}, at::kBool);
    for (int64_t r : {0L, 5L, sq - 1}) st.mask.select(2, r).fill_(false);
  }
  return st;
}

}  // namespace mlacp::test
