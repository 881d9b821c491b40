// The one boundary that checks a forward call's inputs (docs/DESIGN.md §6, §8), in a fixed order:
// hidden state -> unsupported options -> document lengths -> mask -> positions.
// Code behind it trusts the ResolvedForward it returns.
#pragma once

#include "mlacp/attention.h"

namespace mlacp {

// Single device: hidden [B, S, d] holds every token.
ResolvedForward resolve_forward_inputs(const MlaConfig& config, const at::Tensor& hidden,
                                       const MlaForwardOptions& options, bool training);
// One CP shard: hidden [B, S_l, d] holds the global tokens `local_tokens` (S_l of them) of a
// sequence of `global_seq_len` tokens. Document ends and masks are global; position_ids, when
// given, are the shard's own ([S_l] or [B|1, S_l]).
ResolvedForward resolve_forward_inputs(const MlaConfig& config, const at::Tensor& hidden,
                                       const MlaForwardOptions& options, bool training, int64_t global_seq_len,
                                       const std::vector<int64_t>& local_tokens);

// Normalises document boundaries given as ends (with or without a leading 0) and checks them
// against the token count. Shared with the CP runtime's shard helpers.
std::vector<int64_t> normalize_document_ends(const std::vector<int64_t>& ends, int64_t token_count,
                                             const std::string& name);

// Document-relative positions for packed sequences: [S] int64 on the CPU.
at::Tensor packed_positions(const std::vector<int64_t>& document_ends);

}  // namespace mlacp
