// The single-device matrix of `mlacp verify`: finite-difference gradients of every input and
// parameter (tiny preset; with and without gate; both rope layouts; causal and not; packed; band
// mask with a fully masked row; no q latent with YaRN and biases), float32 vs float64, bf16
// autocast, packed == separate documents, masked rows exactly zero.
#include <gtest/gtest.h>

#include "check/single_device_checks.h"

namespace mlacp {
namespace {

class SingleDeviceCase : public ::testing::TestWithParam<VerifyCase> {};

TEST_P(SingleDeviceCase, EveryCheckPasses) {
  const std::vector<CheckRow> rows = run_single_device_checks(GetParam());
  EXPECT_GE(rows.size(), 6u);
  for (const CheckRow& row : rows) {
    EXPECT_TRUE(row.passed()) << row.case_name << " / " << row.quantity << ": error " << row.error
                              << " > tolerance " << row.tolerance;
  }
}

INSTANTIATE_TEST_SUITE_P(Default, SingleDeviceCase, ::testing::ValuesIn(default_single_device_cases()),
                         [](const auto& info) {
                           std::string name = info.param.name;
                           for (char& ch : name)
                             if (ch == '-') ch = '_';
                           return name;
                         });

TEST(SingleDeviceChecks, MatrixCoversTheRequiredVariants) {
  bool gate = false, interleaved = false, noncausal = false, packed = false, masked = false;
  for (const VerifyCase& c : default_single_device_cases()) {
    gate |= c.config.output_gate;
    interleaved |= c.config.rope_layout == RopeLayout::interleaved;
    noncausal |= c.causal.has_value() && !*c.causal;
    packed |= !c.document_ends.empty();
    masked |= !c.masked_rows.empty();
  }
  EXPECT_TRUE(gate && interleaved && noncausal && packed && masked);
}

TEST(SingleDeviceChecks, ChecksThatDoNotApplyYieldNoRows) {
  const VerifyCase plain = find_case("tiny-causal");
  EXPECT_TRUE(check_packed_equals_separate(plain).empty());
  EXPECT_TRUE(check_masked_rows(plain).empty());
}

}  // namespace
}  // namespace mlacp
