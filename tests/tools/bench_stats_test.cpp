// The arithmetic of `mlacp bench` (tools/bench_stats.h), on hand-made samples.
#include "bench_stats.h"

#include <gtest/gtest.h>

namespace mlacp::tools {
namespace {

StepSample step(double step_us, LabelTimes exposed, LabelTimes under = {}, std::map<std::string, int64_t> bytes = {}) {
  StepSample s;
  s.step_us = step_us;
  s.exposed_us = std::move(exposed);
  s.compute_under_us = std::move(under);
  s.bytes = std::move(bytes);
  return s;
}

TEST(BenchStats, MedianOfOddAndEvenCounts) {
  EXPECT_DOUBLE_EQ(median({5, 1, 3}), 3);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(median({}), 0);
}

TEST(BenchStats, MediansPerLabelCountMissingLabelsAsZero) {
  std::vector<StepSample> steps{step(10, {{"q", 1.0}, {"k", 7.0}}), step(30, {{"q", 3.0}}), step(20, {{"q", 2.0}})};
  EXPECT_DOUBLE_EQ(median_step_us(steps), 20);
  const LabelTimes m = median_by_label(steps, &StepSample::exposed_us);
  EXPECT_DOUBLE_EQ(m.at("q"), 2.0);
  EXPECT_DOUBLE_EQ(m.at("k"), 0.0);  // {7, 0, 0}
}

TEST(BenchStats, PairedSavingIsTheMedianOfStepDifferences) {
  std::vector<StepSample> off{step(100, {}), step(200, {}), step(110, {})};
  std::vector<StepSample> on{step(90, {}), step(185, {}), step(108, {})};
  EXPECT_DOUBLE_EQ(median_paired_saving_us(off, on), 10);  // {10, 15, 2}
}

TEST(BenchStats, PlainLabelsOfOverlappedTransfers) {
  const std::map<std::string, int64_t> packed{{"qkv", 1}, {"dqkv", 1}, {"o", 1}, {"do", 1}};
  EXPECT_EQ(plain_label_of("k", packed), "qkv");
  EXPECT_EQ(plain_label_of("kv", packed), "qkv");
  EXPECT_EQ(plain_label_of("dv", packed), "dqkv");
  EXPECT_EQ(plain_label_of("dO", packed), "do");
  const std::map<std::string, int64_t> latent{{"q", 1}, {"latent", 1}, {"dq", 1}, {"dlatent", 1}};
  EXPECT_EQ(plain_label_of("q", latent), "q");
  EXPECT_EQ(plain_label_of("dq", latent), "dq");
  EXPECT_EQ(plain_label_of("dlatent", latent), "dlatent");
}

TEST(BenchStats, ExposureWithoutOverlapIsSharedByBytes) {
  // The plain qkv exchange (600 B) was exposed 60 us; k and v are 200 + 100 of its bytes.
  const LabelTimes plain_exposed{{"qkv", 60.0}, {"do", 8.0}};
  const std::map<std::string, int64_t> plain_bytes{{"qkv", 600}, {"do", 50}};
  const std::map<std::string, int64_t> overlapped_bytes{{"q", 300}, {"k", 200}, {"v", 100}, {"dO", 50}};
  EXPECT_DOUBLE_EQ(exposed_without_overlap_us({"k", "v"}, plain_exposed, plain_bytes, overlapped_bytes), 30.0);
  EXPECT_DOUBLE_EQ(exposed_without_overlap_us({"k", "v", "dO"}, plain_exposed, plain_bytes, overlapped_bytes), 38.0);
  EXPECT_DOUBLE_EQ(exposed_without_overlap_us({"missing"}, plain_exposed, plain_bytes, overlapped_bytes), 0.0);
}

TEST(BenchStats, BandwidthMakesTheTightestTransferTakeTheFraction) {
  // q: 1000 B under 10 us of compute; k: 1000 B under 40 us. Half of q's compute: 5 us -> 2e8 B/s.
  const LabelTimes under{{"q", 10.0}, {"k", 40.0}};
  const std::map<std::string, int64_t> bytes{{"q", 1000}, {"k", 1000}};
  EXPECT_DOUBLE_EQ(bandwidth_for_fraction({"q", "k"}, under, bytes, 0.5), 2e8);
  EXPECT_DOUBLE_EQ(bandwidth_for_fraction({"k"}, under, bytes, 0.5), 5e7);
  EXPECT_DOUBLE_EQ(bandwidth_for_fraction({"absent"}, under, bytes, 0.5), 0.0);
}

}  // namespace
}  // namespace mlacp::tools
