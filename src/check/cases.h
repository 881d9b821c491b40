// Named verification cases: one description names a test, a `mlacp verify` row and (later) a
// benchmark row. Also the deterministic construction of a case's module and inputs.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mlacp/attention.h"

namespace mlacp {

// Parameter values by MlaAttention parameter name ("q_a_proj.weight", ...), e.g. one layer of a
// HuggingFace checkpoint (HfCheckpoint::read_attention_layer).
using CaseWeights = std::vector<std::pair<std::string, at::Tensor>>;

struct VerifyCase {
  std::string name;
  MlaConfig config;
  int64_t batch = 2;
  int64_t seq_len = 9;
  std::optional<bool> causal;          // default: the config's
  std::vector<int64_t> document_ends;  // non-empty: packed sequence (batch 1)
  int64_t band_width = 0;              // > 0: band mask, key allowed iff |i - j| < band_width
  std::vector<int64_t> masked_rows;    // query rows with no allowed key (needs a band mask)
  uint64_t seed = 0;
  // When set, the case module takes these values (converted to its dtype) instead of its seeded
  // random draw; they must be exactly the module's parameters (names and shapes).
  std::shared_ptr<const CaseWeights> weights;
  std::string weights_source;  // where they came from, for descriptions ("checkpoint DIR layer N")
};

struct CaseInputs {
  at::Tensor hidden;          // [B, S, d]
  MlaForwardOptions options;  // positions, documents, mask
  at::Tensor output_weight;   // [B, S, d]: loss = sum(output * output_weight)
};

// The module of a case, deterministic in (config, seed) whatever the dtype: parameters are drawn
// in float32 and then cast, so float32 and float64 modules hold the same values. Norm weights are
// perturbed away from 1 so their gradients are not trivially symmetric. With c.weights the
// parameters are those values instead, converted to `dtype`. Its single-device path runs the
// reference kernel (the oracle).
MlaAttention make_case_module(const VerifyCase& c, at::ScalarType dtype);
CaseInputs make_case_inputs(const VerifyCase& c, at::ScalarType dtype);
// The inputs on `device` (hidden, output weight, mask, positions); made on the host, so every
// device gets the same values.
CaseInputs inputs_on(const CaseInputs& inputs, const c10::Device& device);
// bool [1, 1, S, S] band mask with the case's masked rows.
at::Tensor make_band_mask(int64_t seq_len, int64_t band_width, const std::vector<int64_t>& masked_rows);

// The single-device cases `mlacp verify` runs by default.
std::vector<VerifyCase> default_single_device_cases();
VerifyCase find_case(const std::string& name);

}  // namespace mlacp
