// Piece planning: an AttentionStructure without a boolean mask cut into pieces that a varlen
// attention kernel runs (docs/DESIGN.md §16). A piece is (contiguous query segment × contiguous key
// segment of the same document), either full or causal with bottom-right alignment, so the pieces
// cover exactly the allowed (query, key) pairs, each pair once, and never an S × S tensor.
//
//   segments  rows sorted by token; a segment is a maximal run of consecutive tokens of one
//             document (a head_tail shard: 2 query segments; Ulysses blocks, a packed document
//             crossing shards: one segment per document piece a rank holds)
//   pieces    per (query segment [a, a+m), key segment [c, c+n)) of one document:
//               non-causal: one full piece;
//               causal:     queries with tokens in [max(a,c), min(a+m,c+n)) against keys
//                           [c, min(a+m,c+n)), bottom-right aligned (key j allowed for query i iff
//                           j ≤ i + n' − m', n' ≥ m'); queries with tokens ≥ c+n against the whole
//                           key segment, full; queries before c: no piece.
//   groups    pieces of one kind (causal / full) packed into one varlen call: cu_seqlens over the
//             pieces, the row indices to gather.
//
// Every query row of a piece has at least one allowed key; a row in no piece has none (zero output,
// zero gradient, lse −inf). A row in several pieces (key segments with gaps, or several documents'
// keys — impossible, a row has one document) is combined through the pieces' log-sum-exps.
//
// Host-side only: it reads the structure's token indices and document ends (CPU metadata), never a
// device tensor.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/reference_attention.h"

namespace mlacp {

// One varlen call: pieces of one kind, packed. Row indices are into the structure's query rows
// [0, Sq) and key rows [0, Sk).
struct PieceGroup {
  bool causal = false;                // bottom-right aligned causal pieces; false: full pieces
  std::vector<int64_t> query_rows;    // packed order, the pieces one after the other
  std::vector<int64_t> key_rows;
  std::vector<int64_t> cu_query{0};   // piece p: packed query rows [cu_query[p], cu_query[p+1])
  std::vector<int64_t> cu_key{0};
  int64_t max_query = 0, max_key = 0;  // longest piece
  int64_t pieces() const { return static_cast<int64_t>(cu_query.size()) - 1; }
};

struct PiecePlan {
  int64_t query_rows = 0, key_rows = 0;  // Sq, Sk of the structure
  std::vector<PieceGroup> groups;        // non-empty groups only (at most one causal, one full)
  bool each_row_once = true;             // no query row in two pieces: no combination needed
  int64_t query_segments = 0, key_segments = 0;
  // Allowed pairs the pieces cover (= the structure's allowed pairs) and key rows gathered in all.
  int64_t pairs = 0, gathered_keys = 0;
};

// Requires: no mask (a mask takes the dense masked path), CPU int64 token indices (document ends
// sorted). Errors name the rule.
PiecePlan plan_pieces(const AttentionStructure& structure);

}  // namespace mlacp
