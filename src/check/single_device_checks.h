// The single-device checks of `mlacp verify` (and of the test suite): finite-difference gradients
// of every input and parameter, float32 vs float64, bf16 autocast, packed == separate documents,
// fully masked rows. Each check yields rows of (case, quantity, worst error, tolerance).
#pragma once

#include <string>
#include <vector>

#include "check/cases.h"

namespace mlacp {

struct CheckRow {
  std::string case_name;
  std::string quantity;
  double error = 0.0;
  double tolerance = 0.0;
  bool passed() const { return error <= tolerance; }  // NaN fails
};

// Tolerances (docs/DESIGN.md §9), also quoted in the README.
constexpr double kFiniteDifferenceTolerance = 1e-6;  // float64 central differences, eps 1e-6
constexpr double kFloat32RelTolerance = 1e-5;        // float32 vs float64, relative to max |ref|
// bf16 autocast vs float64, ||err|| / ||ref|| per tensor. bf16 keeps 8 bits (2^-8 = 3.9e-3 per
// rounding); outputs measure 5e-3..1e-2 on the tiny cases, gradients 1.5e-2..4.5e-2 (the
// largest: norm-weight gradients, sums over few tokens with cancellation).
constexpr double kBf16OutputTolerance = 3e-2;
constexpr double kBf16GradTolerance = 8e-2;
constexpr double kExactTolerance = 1e-12;            // float64 identities

struct ForwardBackward {
  at::Tensor output;                                         // [B, S, d]
  std::vector<std::pair<std::string, at::Tensor>> gradients;  // "hidden" and every parameter
};

// Runs forward + backward of loss = sum(output * output_weight); gradients in float64.
ForwardBackward run_forward_backward(MlaAttention& module, const CaseInputs& inputs);

std::vector<CheckRow> check_gradients_fd(const VerifyCase& c);
std::vector<CheckRow> check_float32_agreement(const VerifyCase& c);
std::vector<CheckRow> check_bf16_autocast(const VerifyCase& c);
std::vector<CheckRow> check_packed_equals_separate(const VerifyCase& c);  // packed cases only
std::vector<CheckRow> check_masked_rows(const VerifyCase& c);            // cases with masked rows

// All checks that apply to the case.
std::vector<CheckRow> run_single_device_checks(const VerifyCase& c);

}  // namespace mlacp
