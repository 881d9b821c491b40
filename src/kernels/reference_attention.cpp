#include "kernels/reference_attention.h"

#include <limits>

#include <ATen/ATen.h>

#include "core/device.h"

namespace mlacp {

at::Tensor allowed_pairs(const AttentionStructure& s) {
  // Token indices and document ends are host metadata; with a mask the pairs are built where it lives.
  const c10::Device device = s.mask.defined() ? s.mask.device() : s.query_token_index.device();
  // (host_to_device: a device copy without a host synchronisation; indices already there stay)
  auto on = [&](const at::Tensor& t) { return t.device() == device ? t : host_to_device(t, device); };
  const at::Tensor qi = on(s.query_token_index);  // [Sq]
  const at::Tensor ki = on(s.key_token_index);    // [Sk]
  const at::Tensor ends = s.document_ends.defined() ? on(s.document_ends) : at::Tensor();
  at::Tensor allowed = at::ones({qi.size(0), ki.size(0)}, qi.options().dtype(at::kBool));  // [Sq, Sk]
  if (s.causal) allowed = allowed & (ki.unsqueeze(0) <= qi.unsqueeze(1));
  if (ends.defined()) {
    // Document id of a token = number of document ends at or before it.
    at::Tensor q_doc = at::bucketize(qi, ends, /*out_int32=*/false, /*right=*/true);  // [Sq]
    at::Tensor k_doc = at::bucketize(ki, ends, false, true);                         // [Sk]
    allowed = allowed & (q_doc.unsqueeze(1) == k_doc.unsqueeze(0));
  }
  allowed = allowed.view({1, 1, qi.size(0), ki.size(0)});  // [1, 1, Sq, Sk]
  if (s.mask.defined()) allowed = allowed & s.mask;         // [B|1, 1, Sq, Sk]
  return allowed;
}

at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scaling,
                               const AttentionStructure& structure) {
  at::Tensor allowed = allowed_pairs(structure).to(q.device());          // [B|1, 1, Sq, Sk]
  at::Tensor row_has_key = allowed.any(-1, /*keepdim=*/true);            // [B|1, 1, Sq, 1]
  at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) * scaling;      // [B, H, Sq, Sk]
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  // A row with no allowed key would be all -inf (NaN softmax): give it zeros, then zero it out.
  scores = scores.masked_fill(row_has_key.logical_not(), 0.0);
  at::Tensor probs = at::softmax(scores, -1) * allowed.to(scores.scalar_type());  // [B, H, Sq, Sk]
  return at::matmul(probs.to(v.scalar_type()), v);                                // [B, H, Sq, Dv]
}

}  // namespace mlacp
