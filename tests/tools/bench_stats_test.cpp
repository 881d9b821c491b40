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
  const std::map<std::string, int64_t> packed{{"qkv", 1}, {"dqkv", 1}, {"o", 1}, {"dO", 1}};
  EXPECT_EQ(plain_label_of("k", packed), "qkv");
  EXPECT_EQ(plain_label_of("kv", packed), "qkv");
  EXPECT_EQ(plain_label_of("dv", packed), "dqkv");
  EXPECT_EQ(plain_label_of("dkv", packed), "dqkv");
  EXPECT_EQ(plain_label_of("dO", packed), "dO");
  const std::map<std::string, int64_t> latent{{"q", 1}, {"latent", 1}, {"dq", 1}, {"dlatent", 1}};
  EXPECT_EQ(plain_label_of("q", latent), "q");
  EXPECT_EQ(plain_label_of("dq", latent), "dq");
  EXPECT_EQ(plain_label_of("dlatent", latent), "dlatent");
}

TEST(BenchStats, ExposureWithoutOverlapIsSharedByBytes) {
  // The plain qkv exchange (600 B) was exposed 60 us; k and v are 200 + 100 of its bytes.
  const LabelTimes plain_exposed{{"qkv", 60.0}, {"dO", 8.0}};
  const std::map<std::string, int64_t> plain_bytes{{"qkv", 600}, {"dO", 50}};
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

// Plain: one packed qkv exchange (q 400 B, k 400 B, v 200 B) exposed 100 us each step, steps of
// 1000 us. Overlapped: k and v hidden under 300 us of compute each, q exposed 40 us, steps 930 us.
std::vector<StepSample> plain_steps() {
  std::vector<StepSample> v;
  for (double step_us : {1000.0, 1010.0, 990.0}) v.push_back(step(step_us, {{"qkv", 100.0}}, {}, {{"qkv", 1000}}));
  return v;
}
std::vector<StepSample> overlapped_steps(double k_exposed_us) {
  std::vector<StepSample> v;
  for (double step_us : {930.0, 940.0, 920.0})
    v.push_back(step(step_us, {{"q", 40.0}, {"k", k_exposed_us}, {"v", 0.0}}, {{"q", 1.0}, {"k", 300.0}, {"v", 300.0}},
                     {{"q", 400}, {"k", 400}, {"v", 200}}));
  return v;
}

TEST(BenchStats, OverlapSummaryWithALink) {
  const LinkTime link = [](int64_t bytes) { return 0.25 * static_cast<double>(bytes); };  // 4 B per us
  const OverlapSummary o = summarize_overlap(plain_steps(), overlapped_steps(0.0), {"k", "v"}, link);
  EXPECT_DOUBLE_EQ(o.comm_us, 150.0);                  // 100 + 50 us on the link
  EXPECT_DOUBLE_EQ(o.max_transfer_to_compute, 100.0 / 300.0);
  EXPECT_DOUBLE_EQ(o.queued_us, 0.0);                  // q waited 40 us <= its own 100 us
  EXPECT_DOUBLE_EQ(o.exposed_on_us, 0.0);
  EXPECT_DOUBLE_EQ(o.hidden_percent(), 100.0);
  EXPECT_DOUBLE_EQ(o.exposed_off_us, 60.0);            // 600 of the 1000 plain bytes
  EXPECT_DOUBLE_EQ(o.saved_us, 70.0);                  // 1000 - 930
  EXPECT_DOUBLE_EQ(o.paired_saved_us, 70.0);
  EXPECT_NEAR(o.saved_percent(), 116.67, 0.01);
  EXPECT_TRUE(o.met());
}

TEST(BenchStats, OverlapSummaryCountsExposureAndQueueingAgainstTheOverlappedTransfers) {
  const LinkTime link = [](int64_t bytes) { return 0.25 * static_cast<double>(bytes); };
  std::vector<StepSample> on = overlapped_steps(30.0);
  for (auto& s : on) s.exposed_us["q"] = 130.0;  // 30 us beyond q's own 100 us: queued behind k / v
  const OverlapSummary o = summarize_overlap(plain_steps(), on, {"k", "v"}, link);
  EXPECT_DOUBLE_EQ(o.queued_us, 30.0);
  EXPECT_DOUBLE_EQ(o.exposed_on_us, 60.0);
  EXPECT_DOUBLE_EQ(o.hidden_percent(), 60.0);
  EXPECT_FALSE(o.met());
}

TEST(BenchStats, WithoutALinkDurationsAreTheExposureWithOverlapOff) {
  const OverlapSummary o = summarize_overlap(plain_steps(), overlapped_steps(0.0), {"k", "v"}, LinkTime{});
  EXPECT_DOUBLE_EQ(o.comm_us, 60.0);  // k 40 + v 20: their shares of the plain 100 us
  EXPECT_DOUBLE_EQ(transfer_duration_us("qkv", false, LinkTime{}, plain_steps(), overlapped_steps(0.0)), 100.0);
  EXPECT_DOUBLE_EQ(o.queued_us, 0.0);  // no link: nothing is counted as queued
}

}  // namespace
}  // namespace mlacp::tools
