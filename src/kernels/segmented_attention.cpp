#include "kernels/segmented_attention.h"

#include <algorithm>
#include <memory>

#include <ATen/ATen.h>

#include "core/autograd_node.h"
#include "core/compat.h"
#include "core/format.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "segmented attention";

bool same_data(const at::Tensor& a, const at::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

AttentionStructure query_rows_of(const AttentionStructure& structure, int64_t begin, int64_t rows) {
  AttentionStructure s = structure;
  s.query_token_index = structure.query_token_index.narrow(0, begin, rows);
  if (structure.mask.defined()) s.mask = structure.mask.narrow(2, begin, rows);
  return s;
}

SegmentedAttention::SegmentedAttention(const at::Tensor& k, const at::Tensor& v, double scaling,
                                       AttentionStructure structure, int64_t rows, BlockwiseOptions options)
    : k_(k.detach()),
      v_(v.detach()),
      scaling_(scaling),
      structure_(std::move(structure)),
      rows_(rows),
      options_(options),
      autocast_(compat::AutocastSnapshot::capture(c10::DeviceType::CPU)) {  // the CPU blockwise kernel's rows
  MLACP_REQUIRE(k.dim() == 4 && v.dim() == 4 && structure_.query_token_index.defined() &&
                    structure_.query_token_index.size(0) == rows,
                kWhat, "k and v must be [B,H,Sk,D] and the structure must describe every query row",
                {got("k", shape_text(k)), got("v", shape_text(v)), got("rows", rows),
                 got("structure_rows", structure_.query_token_index.defined() ? structure_.query_token_index.size(0) : -1)},
                "pass the structure of all rows the finished output will have");
  out_ = at::empty({k.size(0), rows, k.size(1), v.size(3)}, v.options()).transpose(1, 2);
}

void SegmentedAttention::compute_rows(const at::Tensor& q_rows, int64_t begin) {
  MLACP_REQUIRE(!finished_, kWhat, "rows computed after finish()", {got("begin", begin)},
                "compute the early rows before finish()");
  const int64_t n = q_rows.dim() == 4 ? q_rows.size(2) : -1;
  MLACP_REQUIRE(n >= 0 && begin >= 0 && begin + n <= rows_, kWhat, "the rows must lie inside [0, Sq)",
                {got("q_rows", shape_text(q_rows)), got("begin", begin), got("rows", rows_)},
                "pass q rows [B,H,n,Dqk] and their first row index");
  for (const Segment& s : segments_)
    MLACP_REQUIRE(begin + n <= s.begin || s.begin + s.rows <= begin, kWhat, "row segments must not overlap",
                  {got("begin", begin), got("rows", n), got("computed_begin", s.begin), got("computed_rows", s.rows)},
                  "compute each row once");
  if (n == 0) return;
  at::Tensor lse = blockwise_attention_forward_into(q_rows, k_, v_, scaling_, query_rows_of(structure_, begin, n),
                                                    out_.narrow(2, begin, n), options_);
  segments_.push_back({begin, n, lse});
}

at::Tensor SegmentedAttention::finish(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  MLACP_REQUIRE(!finished_, kWhat, "finish() called twice", {}, "finish once per forward");
  MLACP_REQUIRE(q.dim() == 4 && q.size(2) == rows_, kWhat, "q must hold every query row",
                {got("q", shape_text(q)), got("rows", rows_)}, "pass q [B,H,Sq,Dqk]");
  MLACP_REQUIRE(same_data(k, k_) && same_data(v, v_), kWhat, "finish() must get the constructor's k and v",
                {got("k", shape_text(k)), got("v", shape_text(v))}, "pass the same tensors (or views of their data)");
  std::sort(segments_.begin(), segments_.end(), [](const Segment& a, const Segment& b) { return a.begin < b.begin; });
  int64_t next = 0;
  const std::vector<Segment> early = segments_;
  for (const Segment& s : early) {
    if (s.begin > next) compute_rows(q.narrow(2, next, s.begin - next), next);
    next = s.begin + s.rows;
  }
  if (next < rows_) compute_rows(q.narrow(2, next, rows_ - next), next);
  finished_ = true;

  const SavedForBackward saved({q.detach(), k_, v_, out_}, {"q", "k", "v", "out"});
  BackwardFn backward = [saved, segments = segments_, structure = structure_, scaling = scaling_, options = options_,
                         autocast = autocast_](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
    saved.check(kWhat);
    // The forward's kernel path depends on autocast: the same path must run backward.
    const auto autocast_guard = autocast.enter();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const at::Tensor dout = grads[0].scalar_type() == out.scalar_type() ? grads[0] : grads[0].to(out.scalar_type());
    BlockwiseGrads g{at::empty_like(q), at::empty_like(k), at::empty_like(v)};
    for (size_t i = 0; i < segments.size(); ++i) {
      const Segment& s = segments[i];
      blockwise_attention_backward_into(
          q.narrow(2, s.begin, s.rows), k, v, out.narrow(2, s.begin, s.rows), s.lse, dout.narrow(2, s.begin, s.rows),
          at::Tensor(), scaling, query_rows_of(structure, s.begin, s.rows),
          {g.dq.narrow(2, s.begin, s.rows), g.dk, g.dv}, /*accumulate_kv=*/i > 0, options);
    }
    if (segments.empty()) g.dk.zero_(), g.dv.zero_();  // no query rows: nothing reaches k, v
    return {g.dq, g.dk, g.dv};
  };
  return attach_backward({q, k, v}, {out_}, "SegmentedAttentionBackward", std::move(backward))[0];
}

}  // namespace mlacp
