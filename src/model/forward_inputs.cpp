#include "model/forward_inputs.h"

#include <cmath>
#include <tuple>

#include <ATen/ATen.h>

#include "core/device.h"
#include "core/format.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "MLA forward";

void check_hidden(const MlaConfig& config, const at::Tensor& hidden) {
  MLACP_REQUIRE(hidden.defined(), kWhat, "hidden states must be a defined tensor", {}, "pass a [B, S, hidden] tensor");
  MLACP_REQUIRE(hidden.dim() == 3, kWhat, "hidden states must be 3-D [B, S, hidden]",
          {got("shape", shape_text(hidden))}, "reshape to [batch, seq, hidden]");
  MLACP_REQUIRE(at::isFloatingType(hidden.scalar_type()), kWhat, "hidden states must be floating point",
          {got("dtype", dtype_name(hidden.scalar_type()))}, "cast to float32/float64 (bf16 via autocast)");
  MLACP_REQUIRE(hidden.size(0) > 0 && hidden.size(1) > 0, kWhat, "hidden states must not be empty",
          {got("shape", shape_text(hidden))}, "pass at least one token");
  MLACP_REQUIRE(hidden.size(2) == config.hidden_size, kWhat, "last dim of hidden states must equal hidden_size",
          {got("hidden.size(-1)", hidden.size(2)), got("hidden_size", config.hidden_size)},
          "check the config matches the model");
}

void check_unsupported(const MlaForwardOptions& o, bool training) {
  MLACP_REQUIRE(!o.use_cache, kWhat, "KV cache is not supported (mlacp is for training)", {got("use_cache", true)},
          "set use_cache=false");
  MLACP_REQUIRE(!o.output_attentions, kWhat, "attention weights cannot be returned (they are never materialised)",
          {got("output_attentions", true)}, "set output_attentions=false");
  MLACP_REQUIRE(std::isfinite(o.dropout) && o.dropout >= 0.0, kWhat, "dropout must be finite and >= 0",
          {got("dropout", o.dropout)}, "use 0");
  MLACP_REQUIRE(!(training && o.dropout > 0.0), kWhat, "attention dropout must be 0 in training (exact attention)",
          {got("dropout", o.dropout), got("training", training)}, "set dropout to 0");
}

at::Tensor resolve_mask(const at::Tensor& mask, const at::Tensor& hidden, int64_t seq, bool packed) {
  if (!mask.defined()) return {};
  const int64_t batch = hidden.size(0);
  MLACP_REQUIRE(!packed, kWhat, "packed sequences and an explicit attention mask are mutually exclusive",
          {got("mask.shape", shape_text(mask))}, "encode documents with document_ends, or build one mask");
  MLACP_REQUIRE(mask.scalar_type() == at::kBool, kWhat,
          "attention_mask must be boolean (True = allowed); additive bias masks are not supported",
          {got("mask.dtype", dtype_name(mask.scalar_type()))}, "convert with mask == 0 for a 0/-inf bias");
  MLACP_REQUIRE(mask.device() == hidden.device(), kWhat, "attention_mask must be on the hidden states' device",
          {got("mask.device", mask.device()), got("hidden.device", hidden.device())}, "move it with .to()");
  const bool square = mask.dim() == 2 && mask.size(0) == seq && mask.size(1) == seq;
  const bool four_d = mask.dim() == 4 && (mask.size(0) == batch || mask.size(0) == 1) && mask.size(1) == 1 &&
                      mask.size(2) == seq && mask.size(3) == seq;
  MLACP_REQUIRE(square || four_d, kWhat, "attention_mask must be [S, S] or [B|1, 1, S, S]",
          {got("mask.shape", shape_text(mask)), got("B", batch), got("S", seq)},
          "pass the global mask over the full sequence");
  return square ? mask.view({1, 1, seq, seq}) : mask;
}

// Positions of the local tokens: given ([S_l] or [B|1, S_l]) or derived from the global token
// index (document-relative when packed). Derived positions are made on the host and reach the
// device without a host synchronisation. The value checks of given positions (>= 0, agreement
// with document_ends) read them: on the CPU they run; on a device they would synchronise the
// host inside the step, so there the positions are taken as given (docs/DESIGN.md §16).
at::Tensor resolve_positions(const at::Tensor& ids, const at::Tensor& hidden, const std::vector<int64_t>* ends,
                             const at::Tensor& local_tokens) {
  const int64_t batch = hidden.size(0), seq = hidden.size(1);
  at::Tensor derived = ends ? packed_positions(*ends).index_select(0, local_tokens) : local_tokens;  // [S_l], host
  derived = host_to_device(derived, hidden.device()).unsqueeze(0).expand({batch, seq});
  if (!ids.defined()) return derived.contiguous();
  MLACP_REQUIRE(!ids.requires_grad(), kWhat, "position_ids must not require grad", {got("requires_grad", true)},
          "pass positions as a constant integer tensor");
  MLACP_REQUIRE(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool, kWhat,
          "position_ids must be an integer tensor", {got("dtype", dtype_name(ids.scalar_type()))},
          "use torch::arange(S, torch::kLong)");
  MLACP_REQUIRE(ids.device() == hidden.device(), kWhat, "position_ids must be on the hidden states' device",
          {got("position_ids.device", ids.device()), got("hidden.device", hidden.device())}, "move it with .to()");
  const bool ok_shape = (ids.dim() == 1 && ids.size(0) == seq) ||
                        (ids.dim() == 2 && (ids.size(0) == batch || ids.size(0) == 1) && ids.size(1) == seq);
  MLACP_REQUIRE(ok_shape, kWhat, "position_ids must be [S] or [B|1, S]",
          {got("position_ids.shape", shape_text(ids)), got("B", batch), got("S", seq)},
          "one position per token");
  at::Tensor positions = (ids.dim() == 1 ? ids.unsqueeze(0) : ids).to(at::kLong).expand({batch, seq}).contiguous();
  // device: value checks read the positions: on the host only
  if (!positions.device().is_cpu()) return positions;
  MLACP_REQUIRE(positions.min().item<int64_t>() >= 0, kWhat, "position_ids must be >= 0",
          {got("min", positions.min().item<int64_t>())}, "positions count from 0");
  if (ends) {
    MLACP_REQUIRE(at::equal(positions, derived), kWhat,
            "conflicting length arguments: position_ids disagree with the positions implied by document_ends",
            {got("document_ends", *ends)}, "pass only document_ends (positions restart per document)");
  }
  return positions;
}

// HuggingFace position_embeddings (cos, sin) [B|1, S_l, Dr] = cat(freqs, freqs) -> the first
// halves [B|1, S_l, Dr/2] (the per-pair rotation).
std::pair<at::Tensor, at::Tensor> resolve_position_embeddings(const MlaConfig& config,
                                                              const std::pair<at::Tensor, at::Tensor>& table,
                                                              const at::Tensor& hidden) {
  const int64_t batch = hidden.size(0), seq = hidden.size(1), dr = config.qk_rope_head_dim;
  const std::pair<const at::Tensor*, const char*> parts[] = {{&table.first, "cos"}, {&table.second, "sin"}};
  for (const auto& [t, name] : parts) {
    MLACP_REQUIRE(t->defined() && t->dim() == 3 && (t->size(0) == batch || t->size(0) == 1) && t->size(1) == seq &&
                      t->size(2) == dr,
                  kWhat, std::string("position_embeddings ") + name + " must be [B|1, S, qk_rope_head_dim]",
                  {got("shape", t->defined() ? shape_text(*t) : std::string("undefined")), got("B", batch),
                   got("S", seq), got("qk_rope_head_dim", dr)},
                  "pass the (cos, sin) of the model's rotary embedding for this rank's tokens");
    MLACP_REQUIRE(at::isFloatingType(t->scalar_type()) && !t->requires_grad() && t->device() == hidden.device(),
                  kWhat, "position_embeddings must be constant floating-point tensors on the hidden states' device",
                  {got("dtype", dtype_name(t->scalar_type())), got("requires_grad", t->requires_grad()),
                   got("device", t->device())},
                  "compute them under no_grad on the same device");
  }
  return {table.first.narrow(-1, 0, dr / 2), table.second.narrow(-1, 0, dr / 2)};
}

}  // namespace

std::vector<int64_t> normalize_document_ends(const std::vector<int64_t>& ends, int64_t token_count,
                                             const std::string& name) {
  std::vector<int64_t> out(ends);
  if (!out.empty() && out.front() == 0) out.erase(out.begin());  // cu_seqlens with its leading 0
  MLACP_REQUIRE(!out.empty(), kWhat, name + " must name at least one document", {got(name, ends)},
          "pass the end of every document, the last one equal to the token count");
  int64_t previous = 0;
  for (int64_t end : out) {
    MLACP_REQUIRE(end > previous, kWhat, name + " must be strictly increasing and positive", {got(name, ends)},
            "pass cumulative ends such as [3, 73, 129, 256]");
    previous = end;
  }
  MLACP_REQUIRE(out.back() == token_count, kWhat, name + " must end at the token count",
          {got(name, ends), got("last", out.back()), got("tokens", token_count)},
          "the last document ends where the sequence ends");
  return out;
}

at::Tensor packed_positions(const std::vector<int64_t>& ends) {
  std::vector<int64_t> positions;
  positions.reserve(ends.back());
  int64_t start = 0;
  for (int64_t end : ends) {
    for (int64_t t = start; t < end; ++t) positions.push_back(t - start);
    start = end;
  }
  return at::tensor(positions, at::TensorOptions().dtype(at::kLong));
}

ResolvedForward resolve_forward_inputs(const MlaConfig& config, const at::Tensor& hidden,
                                       const MlaForwardOptions& options, bool training) {
  check_hidden(config, hidden);
  std::vector<int64_t> all(hidden.size(1));
  for (int64_t t = 0; t < hidden.size(1); ++t) all[t] = t;
  return resolve_forward_inputs(config, hidden, options, training, hidden.size(1), all);
}

ResolvedForward resolve_forward_inputs(const MlaConfig& config, const at::Tensor& hidden,
                                       const MlaForwardOptions& o, bool training, int64_t global_seq_len,
                                       const std::vector<int64_t>& local_tokens) {
  check_hidden(config, hidden);
  MLACP_REQUIRE(hidden.size(1) == static_cast<int64_t>(local_tokens.size()), kWhat,
                "hidden states must hold exactly this rank's tokens",
                {got("hidden.size(1)", hidden.size(1)), got("local_tokens", local_tokens.size()),
                 got("global_seq_len", global_seq_len)},
                "shard the batch with shard_sequence() for the plan's partition");
  check_unsupported(o, training);
  const int64_t batch = hidden.size(0), seq = global_seq_len;

  // Document boundaries.
  MLACP_REQUIRE(!(o.document_ends && o.document_lengths), kWhat,
          "conflicting length arguments: document_ends and document_lengths are both given",
          {got("document_ends", *o.document_ends), got("document_lengths", *o.document_lengths)},
          "pass one of them");
  std::optional<std::vector<int64_t>> ends;
  if (o.document_lengths) {
    MLACP_REQUIRE(!o.document_lengths->empty(), kWhat, "document_lengths must name at least one document",
                  {got("document_lengths", *o.document_lengths)}, "pass the length of every document");
    std::vector<int64_t> cumulative;
    int64_t total = 0;
    for (int64_t length : *o.document_lengths) {
      MLACP_REQUIRE(length > 0, kWhat, "document_lengths must all be > 0", {got("document_lengths", *o.document_lengths)},
              "drop empty documents");
      cumulative.push_back(total += length);
    }
    ends = cumulative;
  } else if (o.document_ends) {
    ends = o.document_ends;
  }
  MLACP_REQUIRE(!(o.key_document_ends && !ends), kWhat, "key_document_ends given without query document ends",
          {got("key_document_ends", *o.key_document_ends)}, "pass document_ends (queries and keys share them)");
  ResolvedForward r;
  r.batch = batch;
  r.seq_len = seq;
  r.causal = o.is_causal.value_or(config.causal);
  if (ends) {
    MLACP_REQUIRE(batch == 1, kWhat, "packed sequences need batch 1", {got("batch", batch)},
            "concatenate the batch into one row and pass its document_ends");
    *ends = normalize_document_ends(*ends, seq, "document_ends");
    if (o.key_document_ends) {
      std::vector<int64_t> key_ends = normalize_document_ends(*o.key_document_ends, seq, "key_document_ends");
      MLACP_REQUIRE(key_ends == *ends, kWhat, "query and key document boundaries must be identical",
              {got("document_ends", *ends), got("key_document_ends", key_ends)},
              "self-attention shares one packing; pass document_ends only");
    }
    r.document_ends = at::tensor(*ends, at::TensorOptions().dtype(at::kLong));  // host metadata
  }
  r.local_tokens = at::tensor(local_tokens, at::TensorOptions().dtype(at::kLong));  // host metadata
  r.mask = resolve_mask(o.attention_mask, hidden, seq, ends.has_value());
  r.rope_positions = resolve_positions(o.position_ids, hidden, ends ? &*ends : nullptr, r.local_tokens);
  if (o.position_embeddings) {
    std::tie(r.rope_cos, r.rope_sin) = resolve_position_embeddings(config, *o.position_embeddings, hidden);
  }
  return r;
}

}  // namespace mlacp
