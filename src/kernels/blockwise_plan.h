// Blockwise attention internals: the Plan (checked arguments, code path, token/document block
// ranges, tile classification and masking), decided once per call and replayed by backward.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "kernels/blockwise_attention.h"

namespace mlacp::blockwise_detail {

constexpr const char* kWhat = "blockwise attention";

// Plan: everything decided once per call (and replayed by backward).
enum class TileKind : uint8_t { skip, full, masked };

struct BlockInfo {
  int64_t begin, size;
  int64_t tok_min, tok_max, doc_min, doc_max;
};

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
  // S^T [k.size rows, ldS]: disallowed (key j, query i) entries become −inf (float, double).
  template <class Acc>
  void apply_mask(int64_t b, int64_t qb, int64_t kb, Acc* st, int64_t ld) const;
};

std::string shape_of(const at::Tensor& t);

// The one boundary: device → dtype → layout → shapes → cross-argument rules → options.
std::shared_ptr<const Plan> make_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                                      const AttentionStructure& st, const BlockwiseOptions& opt);

}  // namespace mlacp::blockwise_detail
