// The naive reference attention: materialised scores, plain ATen ops, float64-capable.
// It is the oracle every faster or parallel path is judged against (docs/DESIGN.md §9): never optimise it.
#pragma once

#include <ATen/core/Tensor.h>

namespace mlacp {

// Which (query row, key row) pairs may attend (docs/DESIGN.md §1 step 7):
//   allowed(i, j) = same document ∧ (key_token ≤ query_token when causal) ∧ mask(i, j)
// Rows carry their *global* token index, so a slice of queries (a CP shard, a Ulysses block,
// a head_tail layout) is described exactly.
// The token indices and document ends are host metadata: CPU tensors whatever the device of
// q, k, v (kernels plan from them without reading a device; docs/DESIGN.md §16). The mask is data
// and lives with the tensors.
struct AttentionStructure {
  bool causal = true;
  at::Tensor query_token_index;  // [Sq] int64 (CPU), global token index of each query row
  at::Tensor key_token_index;    // [Sk] int64 (CPU)
  at::Tensor document_ends;      // [n_docs] int64 (CPU), global exclusive ends; undefined: one document
  at::Tensor mask;               // bool [B|1, 1, Sq, Sk] (True = allowed) or undefined, on the tensors' device
};

// bool [B|1, 1, Sq, Sk], on the mask's device (the indices' without a mask)
at::Tensor allowed_pairs(const AttentionStructure& structure);

// q: [B, H, Sq, Dqk], k: [B, H, Sk, Dqk], v: [B, H, Sk, Dv] -> [B, H, Sq, Dv].
// Rows with no allowed key give exactly zero output and zero gradient (never NaN).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               const AttentionStructure& structure);

}  // namespace mlacp
