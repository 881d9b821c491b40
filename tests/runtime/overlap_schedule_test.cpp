// The overlap schedules run in the order docs/DESIGN.md §5 and their files list (asserted on the
// per-rank timeline: the order of events, not their timings), each overlapped transfer really
// sits under the computation its schedule declares, and their contracts are enforced.
#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "check/cases.h"
#include "core/timeline.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "support/multiprocess.h"

namespace mlacp {
namespace {

// "launch:q", "wait:q", "compute:q_b_proj_rope", ... in time order (transfers left out).
std::vector<std::string> event_order(const Timeline& timeline) {
  std::vector<TimelineEvent> events = timeline.events();
  std::stable_sort(events.begin(), events.end(), [](const auto& a, const auto& b) { return a.begin_us < b.begin_us; });
  std::vector<std::string> order;
  for (const auto& e : events)
    if (e.kind != EventKind::transfer) order.push_back(event_kind_name(e.kind) + ":" + e.name);
  return order;
}

// Asserts that `expected` appears in `order` as a subsequence (in this order).
void expect_in_order(const std::vector<std::string>& order, const std::vector<std::string>& expected) {
  size_t at = 0;
  for (const auto& want : expected) {
    auto it = std::find(order.begin() + static_cast<std::ptrdiff_t>(at), order.end(), want);
    ASSERT_NE(it, order.end()) << "missing or out of order: " << want << "\nfull order:\n"
                               << ::testing::PrintToString(order);
    at = static_cast<size_t>(it - order.begin()) + 1;
  }
}

// Each transfer the schedule declares overlapped is launched before, and waited after, every
// computation it declares to sit under.
void expect_declared_overlaps(const std::vector<std::string>& order, const CpPlan& plan, const MlaConfig& config) {
  const std::vector<OverlappedTransfer> declared = overlapped_transfers(plan, config, c10::DeviceType::CPU);
  EXPECT_FALSE(declared.empty());
  for (const OverlappedTransfer& t : declared) {
    const std::string name = transfer_name(t.transfer);
    const auto launch = std::find(order.begin(), order.end(), "launch:" + name);
    const auto wait = std::find(order.begin(), order.end(), "wait:" + name);
    ASSERT_NE(launch, order.end()) << "declared transfer never launched: " << name;
    ASSERT_NE(wait, order.end()) << "declared transfer never waited: " << name;
    for (const std::string& span : t.under) {
      const auto at = std::find(launch, wait, "compute:" + span);
      EXPECT_NE(at, wait) << name << " is declared to sit under " << span << ", which does not run between its launch"
                          << " and its wait\nfull order:\n" << ::testing::PrintToString(order);
    }
  }
}

std::vector<std::string> one_step(int rank, int world, const std::string& store, CpStrategy strategy, bool gate,
                                  AttentionKernel kernel = AttentionKernel::blockwise, int64_t ulysses = 0,
                                  bool kv_recompute = false) {
  ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, world, 1, ulysses});
  VerifyCase c{"order", preset_config("tiny")};
  c.config.output_gate = gate;
  MlaAttention m = make_case_module(c, at::kDouble);
  const CpPlan plan = parallelize(m, g, {strategy, CpPartition::contiguous, /*overlap=*/true, kernel, kv_recompute});
  at::Tensor x = at::randn({1, 4, 12}, at::kDouble).requires_grad_(true);
  g.instruments.timeline->set_enabled(true);
  m->forward(x).sum().backward();
  g.instruments.timeline->set_enabled(false);
  const std::vector<std::string> order = event_order(*g.instruments.timeline);
  expect_declared_overlaps(order, plan, c.config);
  return order;
}

TEST(OverlapOrder, ExpandedPureUlyssesWithoutGate) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    const auto order = one_step(rank, world, store, CpStrategy::expanded_ulysses, false);
    // Forward: V flies while K is built, K flies under Q, then wait Q, K, V.
    expect_in_order(order, {"compute:kv_b_proj", "launch:v", "compute:build_k", "launch:k", "compute:q_b_proj_rope",
                            "launch:q", "wait:q", "wait:k", "wait:v", "compute:attention"});
    // Backward: dO before the o_proj weight gradient, which it overlaps; then dQ, dK, dV launched,
    // dQ waited at once, the q_b_proj/RoPE backward under dK and dV, the K assembly's under dV.
    expect_in_order(order, {"compute:o_proj_dgrad", "launch:dO", "compute:o_proj_wgrad", "wait:dO", "launch:dq",
                            "launch:dk", "launch:dv", "wait:dq", "compute:q_b_proj_rope_backward", "wait:dk",
                            "compute:build_k_backward", "wait:dv"});
  }));
}

TEST(OverlapOrder, ExpandedPureUlyssesWithGate) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    const auto order = one_step(rank, world, store, CpStrategy::expanded_ulysses, true);
    // The gate projection runs while Q flies.
    expect_in_order(order, {"launch:v", "launch:k", "compute:q_b_proj_rope", "launch:q", "compute:gate_proj", "wait:q",
                            "wait:k", "wait:v"});
    // Backward: the gate backward (between launching dQ and waiting it) overlaps dQ.
    expect_in_order(order, {"launch:dO", "wait:dO", "launch:dq", "launch:dk", "launch:dv", "compute:gate_proj_backward",
                            "wait:dq", "wait:dk", "wait:dv"});
  }));
}

TEST(OverlapOrder, ExpandedHybrid) {
  EXPECT_TRUE(test::run_ranks(4, [](int rank, int world, const std::string& store) {
    const auto order = one_step(rank, world, store, CpStrategy::expanded_ulysses, false, AttentionKernel::blockwise, 2);
    // Forward: the K|V exchange under Q, the K|V gather under the Q exchange.
    expect_in_order(order, {"compute:kv_b_proj", "launch:kv", "compute:q_b_proj_rope", "launch:q", "wait:kv",
                            "launch:kv_gather", "wait:q", "wait:kv_gather", "compute:attention"});
    // Backward: dQ flies under the K|V reduce-scatter and exchange.
    expect_in_order(order, {"launch:dO", "wait:dO", "launch:dq", "launch:dkv_gather", "wait:dkv_gather", "launch:dkv",
                            "wait:dq", "wait:dkv"});
  }));
}

TEST(OverlapOrder, Latent) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    const auto order = one_step(rank, world, store, CpStrategy::latent_kv_head, false);
    // Forward: gather under Q; Q under this rank's KV expansion and the attention of its own
    // query rows (blockwise kernel); the other rows after Q arrives.
    expect_in_order(order, {"launch:latent", "compute:q_b_proj_rope", "wait:latent", "launch:q", "compute:kv_b_proj",
                            "compute:attention_own_rows", "wait:q", "compute:attention"});
    // Backward: dQ first, overlapping the KV backward; the latent reduce-scatter launched before
    // the kv_b_proj weight-gradient GEMM and waited after it.
    expect_in_order(order, {"launch:dO", "compute:o_proj_wgrad", "wait:dO", "launch:dq", "compute:kv_b_proj_dgrad",
                            "launch:dlatent", "compute:kv_b_proj_wgrad", "wait:dlatent", "wait:dq"});
  }));
}

TEST(OverlapOrder, LatentWithKvRecompute) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    const auto order = one_step(rank, world, store, CpStrategy::latent_kv_head, false, AttentionKernel::blockwise, 0,
                                /*kv_recompute=*/true);
    // Forward: each sub-block's K/V (tiny: Hc = 2 heads, one a sub-block) expanded for the own
    // rows under the Q exchange, and again for the other rows after it.
    expect_in_order(order, {"launch:latent", "compute:q_b_proj_rope", "wait:latent", "launch:q", "compute:kv_b_proj",
                            "compute:attention_own_rows", "compute:kv_b_proj", "compute:attention_own_rows", "wait:q",
                            "compute:kv_b_proj", "compute:attention", "compute:kv_b_proj", "compute:attention"});
    // Backward: per sub-block K/V again, its attention backward and dgrad; dQ and the latent's
    // reduce-scatter leave before the last wgrad; the q_b_proj backward runs under the latter.
    expect_in_order(order, {"launch:dO", "compute:o_proj_wgrad", "wait:dO", "compute:kv_b_proj",
                            "compute:attention_backward", "compute:kv_b_proj_dgrad", "compute:kv_b_proj_wgrad",
                            "compute:kv_b_proj", "compute:attention_backward", "compute:kv_b_proj_dgrad", "launch:dq",
                            "launch:dlatent", "compute:kv_b_proj_wgrad", "wait:dq", "compute:q_b_proj_rope_backward",
                            "wait:dlatent"});
  }));
}

TEST(OverlapOrder, LatentWithTheReferenceKernelAttendsAfterQArrives) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    const auto order =
        one_step(rank, world, store, CpStrategy::latent_kv_head, false, AttentionKernel::reference);
    expect_in_order(order, {"launch:q", "compute:kv_b_proj", "wait:q", "compute:attention"});
    EXPECT_EQ(std::count(order.begin(), order.end(), "compute:attention_own_rows"), 0)
        << "the reference kernel has no row segments";
  }));
}

TEST(OverlapOrder, NoGradRunsTheForwardLaunchesWithoutBackwardNodes) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, world, 1, 0});
    VerifyCase c{"nograd", preset_config("tiny")};
    MlaAttention m = make_case_module(c, at::kDouble);
    parallelize(m, g, {CpStrategy::latent_kv_head, CpPartition::contiguous, true});
    at::NoGradGuard no_grad;
    at::Tensor y = m->forward(at::randn({1, 4, 12}, at::kDouble));
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(g.instruments.counters->by_kind(CollectiveKind::all_gather).calls, 1);
  }));
}

TEST(OverlapContract, FrozenInputsSkipTheirCommunication) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, world, 1, 0});
    VerifyCase c{"frozen", preset_config("tiny")};
    MlaAttention m = make_case_module(c, at::kDouble);
    // Everything before o_proj frozen, input too: no dO, dQ, dK, dV or reduce-scatter at all.
    for (auto& item : m->named_parameters())
      if (item.key().rfind("o_proj", 0) != 0) item.value().set_requires_grad(false);
    parallelize(m, g, {CpStrategy::expanded_ulysses, CpPartition::contiguous, true});
    at::Tensor y = m->forward(at::randn({1, 4, 12}, at::kDouble));
    const int64_t forward_calls = g.instruments.counters->by_kind(CollectiveKind::all_to_all).calls;
    y.sum().backward();
    EXPECT_EQ(g.instruments.counters->by_kind(CollectiveKind::all_to_all).calls, forward_calls);
    EXPECT_TRUE(m->o_proj->weight.grad().defined());
  }));
}


// Under a slow emulated link (every transfer queued on one link per process, waits sleeping until
// it is through) the overlap schedules give the plain schedule's results: float64, max abs
// difference <= 1e-12 for the output, the input gradient and every parameter gradient.
struct LinkCase {
  CpStrategy strategy;
  bool gate;
  int world;
  int64_t ulysses;  // 0: U = P
};

void expect_same_results_under_a_slow_link(int rank, int world, const std::string& store, const LinkCase& lc) {
  ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, world, 1, lc.ulysses});
  VerifyCase c{"slow-link", preset_config("tiny")};
  c.config.output_gate = lc.gate;
  at::manual_seed(100 + rank);
  const at::Tensor x0 = at::randn({1, 4, 12}, at::kDouble);
  const at::Tensor dy = at::randn({1, 4, 12}, at::kDouble);
  struct Result {
    at::Tensor y, dx;
    std::vector<at::Tensor> grads;
    double seconds = 0;
    int64_t bytes = 0;
  };
  auto run = [&](bool overlap, const LinkModel& link) {
    *g.instruments.link = link;
    MlaAttention m = make_case_module(c, at::kDouble);
    parallelize(m, g, {lc.strategy, CpPartition::contiguous, overlap});
    at::Tensor x = x0.clone().requires_grad_(true);
    g.instruments.counters->reset();
    barrier(g.world);
    const auto start = std::chrono::steady_clock::now();
    Result r;
    r.y = m->forward(x);
    (r.y * dy).sum().backward();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    r.bytes = g.instruments.counters->total_bytes();
    r.dx = x.grad();
    for (const auto& p : m->parameters()) r.grads.push_back(p.grad());
    return r;
  };
  LinkModel slow;
  slow.latency_seconds = 2e-3;
  slow.bandwidth_bytes_per_second = 2e5;  // 200 KB/s: each transfer of this case takes milliseconds
  const Result plain = run(false, LinkModel{});
  const Result overlapped = run(true, slow);
  // The link was in force: the transfers queued on it take at least their summed link time.
  EXPECT_GE(overlapped.seconds, slow.transfer_seconds(overlapped.bytes) - 1e-3);
  auto max_abs = [](const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); };
  EXPECT_LE(max_abs(plain.y, overlapped.y), 1e-12);
  EXPECT_LE(max_abs(plain.dx, overlapped.dx), 1e-12);
  ASSERT_EQ(plain.grads.size(), overlapped.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    ASSERT_TRUE(plain.grads[i].defined() && overlapped.grads[i].defined()) << "parameter " << i;
    EXPECT_LE(max_abs(plain.grads[i], overlapped.grads[i]), 1e-12) << "parameter " << i;
  }
}

class OverlapUnderASlowLink : public ::testing::TestWithParam<LinkCase> {};

TEST_P(OverlapUnderASlowLink, GivesThePlainResults) {
  const LinkCase lc = GetParam();
  EXPECT_TRUE(test::run_ranks(lc.world, [lc](int rank, int world, const std::string& store) {
    expect_same_results_under_a_slow_link(rank, world, store, lc);
  }));
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, OverlapUnderASlowLink,
    ::testing::Values(LinkCase{CpStrategy::expanded_ulysses, false, 2, 0}, LinkCase{CpStrategy::expanded_ulysses, true, 2, 0},
                      LinkCase{CpStrategy::latent_kv_head, false, 2, 0}, LinkCase{CpStrategy::latent_kv_head, true, 4, 2},
                      LinkCase{CpStrategy::expanded_ulysses, false, 4, 2}),
    [](const ::testing::TestParamInfo<LinkCase>& info) {
      const LinkCase& lc = info.param;
      return std::string(lc.strategy == CpStrategy::latent_kv_head ? "latent" : "expanded") +
             (lc.gate ? "_gate" : "") + "_world" + std::to_string(lc.world) + "_u" +
             std::to_string(lc.ulysses ? lc.ulysses : lc.world);
    });

}  // namespace
}  // namespace mlacp
