// The planner's step model, ranking, explanation and hardware files (include/mlacp/planner.h).
// Its predictions against measured steps: tests/tools/plan_grid.py (the suite's small grid).
#include <chrono>
#include <cmath>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "mlacp/errors.h"
#include "mlacp/memory.h"
#include "mlacp/planner.h"
#include "mlacp/runtime.h"

namespace mlacp {
namespace {

using ::testing::HasSubstr;

PlanRequest request_for(const MlaConfig& config, int64_t seq, int64_t cp, int64_t tp = 1) {
  PlanRequest r;
  r.config = config;
  r.seq_len = seq;
  r.cp = cp;
  r.tp = tp;
  r.hardware = hardware_profile("h200-nvlink-ib");
  return r;
}

std::vector<CpPlan> every_plan(const MlaConfig& config, int64_t tp) {
  std::vector<CpPlan> plans;
  for (int64_t p : {1, 2, 4, 8})
    for (int64_t u = 1; u <= p; ++u) {
      if (p % u != 0) continue;
      for (CpStrategy s : {CpStrategy::latent_kv_head, CpStrategy::expanded_ulysses})
        for (bool overlap : {false, true})
          for (AttentionKernel kernel : {AttentionKernel::blockwise, AttentionKernel::reference}) {
            MeshShape shape;
            shape.cp = p;
            shape.tp = tp;
            shape.ulysses = u;
            CpPlanSpec spec = plan_spec_for(config, shape, s, CpPartition::head_tail, overlap);
            spec.kernel = kernel;
            plans.emplace_back(spec);
          }
    }
  return plans;
}

MlaConfig test_config(bool gate) {
  MlaConfig c = preset_config("deepseek-v3");
  c.num_heads = 16;
  c.hidden_size = 1024;
  c.output_gate = gate;
  return c;
}

TEST(Planner, TransfersSumToTheVolumeFormulaForEveryPlan) {
  for (bool gate : {false, true})
    for (int64_t tp : {1, 2}) {
      const MlaConfig c = test_config(gate);
      for (const CpPlan& plan : every_plan(c, tp)) {
        PlanRequest r = request_for(c, 4096, plan.cp(), tp);
        r.dtype = "float32";
        const CandidatePrediction p = predict_step(plan, r);
        const CommVolume v = expected_comm_elements(plan, r.batch, r.seq_len);
        double cp_bytes = 0;
        for (const TransferPrediction& t : p.transfers)
          if (t.name.rfind("tp_", 0) != 0) cp_bytes += t.bytes;
        const double formula = 4.0 * static_cast<double>(v.forward_all_to_all + v.forward_all_gather + v.forward_output +
                                                         v.backward_all_to_all + v.backward_reduce);
        EXPECT_DOUBLE_EQ(cp_bytes, formula) << plan.to_text();
        EXPECT_EQ(p.transfers.size() > 0, plan.cp() > 1 || tp > 1) << plan.to_text();
      }
    }
}

TEST(Planner, EverySpanASchedulesDeclaresIsModelledAndOverlapOnlyHides) {
  for (bool gate : {false, true})
    for (const CpPlan& plan : every_plan(test_config(gate), 1)) {
      PlanRequest r = request_for(test_config(gate), 8192, plan.cp());
      r.hardware.intra_node.bandwidth_bytes_per_s = 5e9;  // slow enough for transfers to be exposed
      const CandidatePrediction p = predict_step(plan, r);  // throws on an unknown span
      EXPECT_GE(p.exposed_comm_s, 0.0);
      EXPECT_LE(p.exposed_comm_s, p.comm_s * (1 + 1e-12));
      EXPECT_NEAR(p.step_s, p.compute_s + p.exposed_comm_s, 1e-12);
      CpPlanSpec off = plan.spec();
      off.overlap = false;
      const CandidatePrediction plain = predict_step(CpPlan(off), r);
      EXPECT_LE(p.step_s, plain.step_s * (1 + 1e-12)) << plan.to_text();
      EXPECT_DOUBLE_EQ(p.bytes_per_rank, plain.bytes_per_rank) << plan.to_text();  // the same bytes, split differently
      if (plan.overlap() && plan.cp() > 1 && !overlapped_transfers(plan, test_config(gate), c10::DeviceType::CPU).empty())
        EXPECT_LT(p.exposed_comm_s, plain.exposed_comm_s) << plan.to_text();
    }
}

TEST(Planner, HeadTailBalancesCausalAttentionAcrossUlyssesGroups) {
  const MlaConfig c = test_config(false);
  PlanRequest r = request_for(c, 16384, 4);
  for (int64_t u : {1, 2}) {
    MeshShape shape;
    shape.cp = 4;
    shape.ulysses = u;
    auto attention = [&](CpPartition partition) {
      const CandidatePrediction p =
          predict_step(CpPlan(plan_spec_for(c, shape, CpStrategy::latent_kv_head, partition, false)), r);
      for (const auto& [name, s] : p.phases)
        if (name == "attention") return s;
      return 0.0;
    };
    // Contiguous: the last group holds the most visible keys; head_tail gives every group a share.
    EXPECT_GT(attention(CpPartition::contiguous), 1.3 * attention(CpPartition::head_tail)) << "U=" << u;
  }
}

TEST(Planner, RanksFastestFirstAndExplainsTheChoiceWithItsNumbers) {
  PlanRequest r = request_for(preset_config("deepseek-v3"), 131072, 0);
  r.devices = 8;
  const PlanReport report = plan_context_parallel(r);
  ASSERT_TRUE(report.any_feasible());
  EXPECT_EQ(report.chosen, 0u);
  for (size_t i = 1; i < report.candidates.size(); ++i)
    if (report.candidates[i].feasible) EXPECT_LE(report.candidates[i - 1].step_s, report.candidates[i].step_s);
  EXPECT_THAT(report.explanation, HasSubstr("chosen: " + report.choice().label()));
  EXPECT_THAT(report.explanation, HasSubstr("the K/V exchange moves"));
  EXPECT_THAT(report.explanation, HasSubstr("repeated up-projection"));
  EXPECT_THAT(report.to_text(), HasSubstr(report.choice().label()));
  EXPECT_THAT(report.to_json(), HasSubstr("\"chosen\": 0"));
}

TEST(Planner, ASlowLinkChoosesTheFewestBytes) {
  PlanRequest r = request_for(preset_config("deepseek-v3"), 32768, 8);
  r.hardware.intra_node.bandwidth_bytes_per_s = 1e6;  // 1 MB/s: communication is everything
  const PlanReport report = plan_context_parallel(r);
  double fewest = 1e300;
  for (const CandidatePrediction& c : report.candidates)
    if (c.feasible) fewest = std::min(fewest, c.bytes_per_rank);
  EXPECT_DOUBLE_EQ(report.choice().bytes_per_rank, fewest);
  EXPECT_EQ(report.choice().spec.strategy, CpStrategy::latent_kv_head);
  EXPECT_EQ(report.choice().spec.ulysses, 1);  // the latent gather alone: no Q/O exchange
}

// Across nodes that share one link (CPU hosts, --calibrate-link): a ring with m members on a node
// crosses it alongside node/m others, so it gets m ranks' share; an all-to-all is as before.
TEST(Planner, ASharedNodeLinkGivesARingItsMembersShare) {
  const MlaConfig c = test_config(false);
  PlanRequest r = request_for(c, 4096, 4);
  r.hardware.devices_per_node = 2;
  r.hardware.cores_per_node = 0;
  r.hardware.intra_node = {1e9, 1e-5};
  r.hardware.inter_node = {1e8, 1e-4};
  MeshShape shape;
  shape.cp = 4;
  shape.ulysses = 1;  // one all-gather ring over the 4 ranks: 2 members a node
  const CpPlan plan(plan_spec_for(c, shape, CpStrategy::latent_kv_head, CpPartition::head_tail, false));
  const CandidatePrediction own = predict_step(plan, r);
  PlanRequest shared = r;
  shared.hardware.shared_node_link = 1;
  const CandidatePrediction on_shared = predict_step(plan, shared);
  ASSERT_FALSE(own.transfers.empty());
  for (size_t i = 0; i < own.transfers.size(); ++i) {
    const TransferPrediction& t = own.transfers[i];
    EXPECT_DOUBLE_EQ(t.seconds, 1e-4 + t.bytes / 1e8) << t.name;
    EXPECT_DOUBLE_EQ(on_shared.transfers[i].seconds, 1e-4 + t.bytes / 2e8) << t.name;
  }
  shape.ulysses = 4;  // all-to-alls over both nodes: unchanged
  const CpPlan a2a(plan_spec_for(c, shape, CpStrategy::latent_kv_head, CpPartition::head_tail, false));
  const CandidatePrediction a = predict_step(a2a, r), b = predict_step(a2a, shared);
  for (size_t i = 0; i < a.transfers.size(); ++i)
    if (a.transfers[i].name == "q") EXPECT_DOUBLE_EQ(a.transfers[i].seconds, b.transfers[i].seconds);
  EXPECT_NE(Hardware::from_json(shared.hardware.to_json()).shared_node_link, 0);
}

// bench's emulated link: every transfer takes the longer of it and the hardware's link.
TEST(Planner, AnEmulatedLinkIsAFloorOnEveryTransfer) {
  const MlaConfig c = test_config(false);
  PlanRequest r = request_for(c, 4096, 4);
  MeshShape shape;
  shape.cp = 4;
  shape.ulysses = 2;
  for (CpStrategy s : {CpStrategy::latent_kv_head, CpStrategy::expanded_ulysses}) {
    const CpPlan plan(plan_spec_for(c, shape, s, CpPartition::head_tail, true));
    const CandidatePrediction base = predict_step(plan, r);
    ASSERT_FALSE(base.transfers.empty());
    PlanRequest slow = r;
    slow.emulated_link = {1e8, 1e-3};  // far slower than NVLink: the emulated time decides
    PlanRequest fast = r;
    fast.emulated_link = {1e15, 0.0};  // far faster: the hardware's link decides
    const CandidatePrediction on_slow = predict_step(plan, slow), on_fast = predict_step(plan, fast);
    for (size_t i = 0; i < base.transfers.size(); ++i) {
      const TransferPrediction& t = base.transfers[i];
      EXPECT_DOUBLE_EQ(on_slow.transfers[i].seconds, std::max(t.seconds, 1e-3 + t.bytes / 1e8)) << t.name;
      EXPECT_DOUBLE_EQ(on_fast.transfers[i].seconds, t.seconds) << t.name;
    }
    EXPECT_GT(on_slow.step_s, base.step_s);
    EXPECT_DOUBLE_EQ(on_fast.step_s, base.step_s);
  }
}

// The calibration on this host: every figure measured, finite and positive, the link from two
// real ranks over Gloo, and the result a hardware file that plans.
TEST(Planner, CalibrationMeasuresRatesTheLinkAndTheElementwiseCost) {
  MlaConfig c = preset_config("tiny");
  CalibrationOptions options;
  options.seq_len = 128;
  options.repeats = 1;
  for (bool cp_step : {true, false}) {
    options.cp_step = cp_step;
    options.concurrent = cp_step;  // the single-device form is what Python runs (no fork)
    const Hardware hw = calibrate_host(c, options);
    ASSERT_EQ(hw.rates.count("float32"), 1u);
    const ComputeRates& rates = hw.rates.at("float32");
    EXPECT_GT(rates.gemm_flops, 0);
    EXPECT_GT(rates.attention_forward_flops, 0);
    EXPECT_GT(rates.attention_backward_flops, 0);
    EXPECT_GE(rates.seconds_per_element, 0);
    EXPECT_TRUE(std::isfinite(rates.seconds_per_element));
    if (cp_step) {
      EXPECT_GT(hw.intra_node.bandwidth_bytes_per_s, 0);
      EXPECT_TRUE(std::isfinite(hw.intra_node.bandwidth_bytes_per_s));
      EXPECT_GE(hw.intra_node.latency_s, 0);
      EXPECT_LT(hw.intra_node.latency_s, 1.0);
      EXPECT_THAT(hw.source, HasSubstr("two local ranks"));
    } else {
      EXPECT_EQ(hw.intra_node.bandwidth_bytes_per_s, 0);
      EXPECT_THAT(hw.source, HasSubstr("link not measured"));
    }
    PlanRequest r;
    r.config = c;
    r.seq_len = 256;
    r.cp = 2;
    r.dtype = "float32";
    r.hardware = Hardware::from_json(hw.to_json());
    EXPECT_TRUE(plan_context_parallel(r).any_feasible());
  }
  options.seq_len = 130;  // two ranks, head_tail: 4 chunks
  EXPECT_THROW(calibrate_host(c, options), Error);
}

TEST(Planner, InfeasibleCandidatesAreListedWithTheRuleTheyBreak) {
  MlaConfig c = test_config(false);
  c.num_heads = 6;  // U = 4 does not divide the heads
  PlanRequest r = request_for(c, 4096, 4);
  PlanReport report = plan_context_parallel(r);
  bool found = false;
  for (const CandidatePrediction& x : report.candidates)
    if (x.spec.ulysses == 4) {
      EXPECT_FALSE(x.feasible);
      EXPECT_THAT(x.infeasible_reason, HasSubstr("heads"));
      found = true;
    }
  EXPECT_TRUE(found);
  EXPECT_THAT(report.to_text(), HasSubstr("infeasible:"));
  // Memory: a device too small for every candidate.
  r.hardware.memory_bytes = 1024;
  report = plan_context_parallel(r);
  EXPECT_FALSE(report.any_feasible());
  EXPECT_THAT(report.explanation, HasSubstr("no candidate is feasible"));
  EXPECT_THAT(report.candidates.front().infeasible_reason, HasSubstr("per rank; the device has"));
  // A sequence the partition cannot split.
  r = request_for(c, 4098, 4);
  report = plan_context_parallel(r);
  for (const CandidatePrediction& x : report.candidates) EXPECT_FALSE(x.feasible);
}

// A candidate's memory is one layer's forward + backward counted as bench and train count it: under
// bf16 autocast the parameters and the projections at float32 width, what attention exchanges and
// its kernel's buffers at bf16 width (before, everything at float32 width: bf16 candidates looked
// up to twice their size and were refused or given K/V recompute for nothing).
TEST(Planner, CountsALayersMemoryAtTheWidthsTheRunUses) {
  const MlaConfig c = test_config(false);
  double float32_bytes = 0, bf16_bytes = 0;
  for (const char* dtype : {"float32", "bfloat16"})  // the H200 profile has no float64 rates
    for (int64_t u : {1, 2}) {
      const bool bf16 = std::string(dtype) == "bfloat16";
      PlanRequest r = request_for(c, 8192, 4);
      r.dtype = dtype;
      const CpPlan plan(plan_spec_for(c, MeshShape{1, 4, 1, u}, CpStrategy::latent_kv_head, CpPartition::head_tail, true));
      LayerShape shape;
      shape.batch = r.batch;
      shape.seq_len = r.seq_len;
      shape.hidden = c.hidden_size;
      shape.q_latent = c.q_lora_rank.has_value();
      shape.element_bytes = 4;
      shape.attention_bytes = bf16 ? 2 : 0;
      const double bytes = predict_step(plan, r).memory_bytes;
      EXPECT_DOUBLE_EQ(bytes, layer_memory(plan, shape).total()) << dtype << " U=" << u;
      if (u == 1) (bf16 ? bf16_bytes : float32_bytes) = bytes;
    }
  EXPECT_LT(bf16_bytes, 0.8 * float32_bytes);  // the gathered latent and the head block's K/V, halved
}

// Short of memory, the latent strategy keeps the latent instead of its head block's K/V: the
// planner tries K/V recompute where a latent candidate's layer does not fit, charges its extra
// kv_b_proj pass, and says why it chose it; with room, it never does.
TEST(Planner, ChoosesKvRecomputeOnlyWhenTheLayerDoesNotFitWithoutIt) {
  PlanRequest r = request_for(test_config(false), 32768, 4);
  r.strategies = {CpStrategy::latent_kv_head};
  r.ulysses = 1;  // all 16 heads in one block: K/V of all S keys for 16 heads, or of a sub-block
  r.partitions = {CpPartition::head_tail};
  r.overlaps = {true};
  r.kv_recompute_when_short = true;  // a CPU run
  PlanReport roomy = plan_context_parallel(r);
  ASSERT_TRUE(roomy.any_feasible());
  for (const CandidatePrediction& x : roomy.candidates) EXPECT_FALSE(x.spec.kv_recompute) << x.label();
  const CandidatePrediction plain = roomy.choice();
  CpPlanSpec kv_spec = plain.spec;
  kv_spec.kv_recompute = true;
  const CandidatePrediction kv = predict_step(CpPlan(kv_spec), r);
  ASSERT_LT(kv.memory_bytes, plain.memory_bytes);
  EXPECT_GT(kv.upprojection_s, plain.upprojection_s);  // one more kv_b_proj pass
  EXPECT_GT(kv.step_s, plain.step_s);

  r.hardware.memory_bytes = (kv.memory_bytes + plain.memory_bytes) / 2;  // fits with it only
  const PlanReport tight = plan_context_parallel(r);
  ASSERT_TRUE(tight.any_feasible()) << tight.explanation;
  EXPECT_TRUE(tight.choice().spec.kv_recompute);
  EXPECT_THAT(tight.choice().label(), HasSubstr("kv_recompute"));
  EXPECT_THAT(tight.explanation, HasSubstr("kv_recompute: without it one layer's forward + backward needs"));
  EXPECT_THAT(tight.to_json(), HasSubstr("\"kv_recompute\": true"));
  bool twin_listed = false;
  for (const CandidatePrediction& x : tight.candidates)
    if (!x.spec.kv_recompute) {
      EXPECT_FALSE(x.feasible);
      EXPECT_THAT(x.infeasible_reason, HasSubstr("per rank; the device has"));
      twin_listed = true;
    }
  EXPECT_TRUE(twin_listed);

  r.kv_recompute_when_short = false;  // never: nothing fits
  EXPECT_FALSE(plan_context_parallel(r).any_feasible());
  r.kv_recompute_when_short = true;
  r.hardware.memory_bytes = kv.memory_bytes / 2;  // not even with it
  const PlanReport none = plan_context_parallel(r);
  EXPECT_FALSE(none.any_feasible());
  EXPECT_THAT(none.explanation, HasSubstr("no candidate is feasible"));
}

TEST(Planner, RejectsAnInvalidRequestAsAWhole) {
  PlanRequest r = request_for(test_config(false), 0, 4);
  EXPECT_THROW(plan_context_parallel(r), Error);
  r = request_for(test_config(false), 1024, 4);
  r.dtype = "float64";  // the GPU profiles have no float64 rates
  try {
    plan_context_parallel(r);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no rates for the run's dtype"));
  }
  r.dtype = "bfloat16";
  r.devices = 8;  // and cp = 4
  EXPECT_THROW(plan_context_parallel(r), Error);
}

TEST(Planner, HardwareFilesRoundTripAndNameTheirBadField) {
  const Hardware h = hardware_profile("h100-nvlink-ib");
  const Hardware back = Hardware::from_json(h.to_json());
  EXPECT_EQ(back.to_json(), h.to_json());
  EXPECT_THAT(h.source, HasSubstr("datasheet"));
  try {
    Hardware::from_json(R"({"memory_bytes": 1, "rates": {"float32": {"gemm_flops": -1}}})");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("gemm_flops"));
  }
  EXPECT_THROW(Hardware::from_json("{"), Error);
  EXPECT_THROW(hardware_profile("a100"), Error);
}

TEST(Planner, AnswersForEveryPresetInUnderASecond) {
  for (const std::string& preset : preset_names())
    for (int64_t devices : {8, 64}) {
      PlanRequest r = request_for(preset_config(preset), 1 << 20, 0);
      r.devices = devices;
      const auto start = std::chrono::steady_clock::now();
      const PlanReport report = plan_context_parallel(r);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(s, 1.0) << preset;
      EXPECT_FALSE(report.candidates.empty());
    }
}

}  // namespace
}  // namespace mlacp
