// The one boundary that checks a forward call's inputs (SPEC §6, §8), in a fixed order:
// hidden state -> unsupported options -> document lengths -> mask -> positions.
// Code behind it trusts the ResolvedForward it returns.
#pragma once

#include "mlacp/attention.h"

namespace mlacp {

ResolvedForward resolve_forward_inputs(const MlaConfig& config, const at::Tensor& hidden,
                                       const MlaForwardOptions& options, bool training);

// Normalises document boundaries given as ends (with or without a leading 0) and checks them
// against the token count. Shared with the CP runtime's shard helpers.
std::vector<int64_t> normalize_document_ends(const std::vector<int64_t>& ends, int64_t token_count,
                                             const std::string& name);

// Document-relative positions for packed sequences: [S] int64.
at::Tensor packed_positions(const std::vector<int64_t>& document_ends, const at::TensorOptions& options);

}  // namespace mlacp
