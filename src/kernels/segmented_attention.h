// Attention whose query rows are computed in segments at different times, under one autograd
// node: a schedule computes the rows it already holds while the others are still in flight
// (docs/DESIGN.md §5, latent strategy: this rank's own rows under the Q exchange). Blockwise kernel.
//
//   SegmentedAttention a(k, v, scaling, structure, rows);  // structure describes all `rows` rows
//   a.compute_rows(q_rows, begin);                          // rows [begin, begin+n): now, no graph
//   at::Tensor out = a.finish(q, k, v);                     // the other rows, then one node (q, k, v)
//
// Contract: the rows of `q` computed early hold the values given to compute_rows (a schedule
// passes the same data before and after its exchange); k and v given to finish are the
// constructor's tensors or views of the same data with autograd history. The output and the
// gradients equal one blockwise call's up to summation order (dK/dV add over the segments in
// place, no extra pass). Autocast state of the constructor is re-entered in backward.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/compat.h"

#include "kernels/blockwise_attention.h"

namespace mlacp {

// The structure of rows [begin, begin + rows) of `structure`'s queries.
AttentionStructure query_rows_of(const AttentionStructure& structure, int64_t begin, int64_t rows);

class SegmentedAttention {
 public:
  // k [B,H,Sk,Dqk], v [B,H,Sk,Dv]; `rows` = Sq, the query rows `structure` describes.
  SegmentedAttention(const at::Tensor& k, const at::Tensor& v, double scaling, AttentionStructure structure,
                     int64_t rows, BlockwiseOptions options = {});
  // Forward of rows [begin, begin + q_rows.size(2)) now (q_rows [B,H,n,Dqk]); no autograd.
  void compute_rows(const at::Tensor& q_rows, int64_t begin);
  // Computes the rows not computed yet from q [B,H,Sq,Dqk] and returns out [B,H,Sq,Dv],
  // differentiable w.r.t. q, k, v. Once.
  at::Tensor finish(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

 private:
  struct Segment {
    int64_t begin = 0, rows = 0;
    at::Tensor lse;  // [B,H,rows]
  };
  at::Tensor k_, v_, out_;  // out_ [B,H,Sq,Dv] in [B,Sq,H,Dv] memory, like the blockwise kernel's
  double scaling_;
  AttentionStructure structure_;
  int64_t rows_;
  BlockwiseOptions options_;
  compat::AutocastSnapshot autocast_;
  std::vector<Segment> segments_;
  bool finished_ = false;
};

}  // namespace mlacp
