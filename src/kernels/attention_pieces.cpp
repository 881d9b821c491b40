#include "kernels/attention_pieces.h"

#include <algorithm>
#include <numeric>

#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "piece attention";

std::vector<int64_t> host_values(const at::Tensor& t, const char* name) {
  // device: host metadata stays on the CPU (reading a device would synchronise)
  MLACP_REQUIRE(t.defined() && t.dim() == 1 && t.scalar_type() == at::kLong && t.device().is_cpu(), kWhat,
                "the structure's token indices and document ends are 1-D int64 tensors on the CPU (host metadata: "
                "reading them from a device would synchronise the host)",
                {got("tensor", name), got("defined", t.defined()), got("dim", t.defined() ? t.dim() : -1),
                 got("dtype", t.defined() ? c10::toString(t.scalar_type()) : "none"),
                 got("device", t.defined() ? t.device().str() : "none")},
                "build the AttentionStructure's index tensors on the CPU as int64 (at::tensor(values, at::kLong))");
  at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// A run of consecutive tokens of one document: rows in token order.
struct Segment {
  int64_t document = 0, first_token = 0;
  std::vector<int64_t> rows;
  int64_t size() const { return static_cast<int64_t>(rows.size()); }
};

std::vector<Segment> segments_of(const std::vector<int64_t>& tokens, const std::vector<int64_t>& ends) {
  auto document_of = [&](int64_t token) {
    return static_cast<int64_t>(std::upper_bound(ends.begin(), ends.end(), token) - ends.begin());
  };
  std::vector<int64_t> order(tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return tokens[x] < tokens[y]; });
  std::vector<Segment> segments;
  for (int64_t row : order) {
    const int64_t token = tokens[row], document = document_of(token);
    if (segments.empty() || segments.back().document != document ||
        segments.back().first_token + segments.back().size() != token) {
      segments.push_back({document, token, {}});
    }
    segments.back().rows.push_back(row);
  }
  return segments;
}

void add_piece(PieceGroup& g, const std::vector<int64_t>& q_rows, int64_t q_begin, int64_t q_count,
               const std::vector<int64_t>& k_rows, int64_t k_count) {
  g.query_rows.insert(g.query_rows.end(), q_rows.begin() + q_begin, q_rows.begin() + q_begin + q_count);
  g.key_rows.insert(g.key_rows.end(), k_rows.begin(), k_rows.begin() + k_count);
  g.cu_query.push_back(g.cu_query.back() + q_count);
  g.cu_key.push_back(g.cu_key.back() + k_count);
  g.max_query = std::max(g.max_query, q_count);
  g.max_key = std::max(g.max_key, k_count);
}

}  // namespace

PiecePlan plan_pieces(const AttentionStructure& st) {
  MLACP_REQUIRE(!st.mask.defined(), kWhat, "a structure with a boolean mask has no piece form", {},
                "run it through the masked path (piece_attention does so itself)");
  const std::vector<int64_t> q_tokens = host_values(st.query_token_index, "query_token_index");
  const std::vector<int64_t> k_tokens = host_values(st.key_token_index, "key_token_index");
  std::vector<int64_t> ends;
  if (st.document_ends.defined()) {
    ends = host_values(st.document_ends, "document_ends");
    MLACP_REQUIRE(std::is_sorted(ends.begin(), ends.end()), kWhat, "document ends must be sorted",
                  {got("document_ends", ends)}, "pass the exclusive ends in increasing order");
  }
  PiecePlan plan;
  plan.query_rows = static_cast<int64_t>(q_tokens.size());
  plan.key_rows = static_cast<int64_t>(k_tokens.size());
  const std::vector<Segment> qs = segments_of(q_tokens, ends), ks = segments_of(k_tokens, ends);
  plan.query_segments = static_cast<int64_t>(qs.size());
  plan.key_segments = static_cast<int64_t>(ks.size());
  PieceGroup causal, full;
  causal.causal = true;
  std::vector<int64_t> pieces_of_row(q_tokens.size(), 0);
  auto count_rows = [&](const Segment& q, int64_t begin, int64_t count, int64_t keys, bool is_causal) {
    for (int64_t r = begin; r < begin + count; ++r) ++pieces_of_row[q.rows[r]];
    // causal bottom-right: row i of m sees i + 1 + (keys - count) keys
    plan.pairs += is_causal ? count * (keys - count) + count * (count + 1) / 2 : count * keys;
    plan.gathered_keys += keys;
  };
  for (const Segment& q : qs) {
    const int64_t a = q.first_token, m = q.size();
    for (const Segment& k : ks) {
      if (k.document != q.document) continue;
      const int64_t c = k.first_token, n = k.size();
      if (!st.causal) {
        add_piece(full, q.rows, 0, m, k.rows, n);
        count_rows(q, 0, m, n, false);
        continue;
      }
      const int64_t lo = std::max(a, c), hi = std::min(a + m, c + n);
      if (lo < hi) {  // queries inside the key segment's span: keys [c, hi), bottom-right aligned
        add_piece(causal, q.rows, lo - a, hi - lo, k.rows, hi - c);
        count_rows(q, lo - a, hi - lo, hi - c, true);
      }
      const int64_t after = std::max(a, c + n);  // queries past the key segment see all of it
      if (after < a + m) {
        add_piece(full, q.rows, after - a, a + m - after, k.rows, n);
        count_rows(q, after - a, a + m - after, n, false);
      }
    }
  }
  for (int64_t count : pieces_of_row) plan.each_row_once = plan.each_row_once && count <= 1;
  if (causal.pieces() > 0) plan.groups.push_back(std::move(causal));
  if (full.pieces() > 0) plan.groups.push_back(std::move(full));
  return plan;
}

}  // namespace mlacp
