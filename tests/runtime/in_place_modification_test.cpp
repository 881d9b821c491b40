// A tensor that a CP schedule saved for backward and that is then modified in place makes the
// backward fail with an error naming the in-place modification (LibTorch's version check, or
// mlacp's SavedForBackward), never a gradient silently computed from the new values. Checked for
// every schedule of the CP runtime (plain and overlapped) and every parameter and the input.
//
// Every rank runs the same forward, makes the same in-place change and runs the same backward, so
// every rank throws at the same node (a rank throwing before a collective its peers enter would
// leave them blocked); a barrier after the backward keeps the ranks together.
#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "check/cases.h"
#include "mlacp/runtime.h"
#include "support/multiprocess.h"

namespace mlacp {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr const char* kHidden = "hidden";  // the input hidden state, next to the parameter names

// One schedule of the CP runtime: strategy, world (= P), Ulysses degree (0: U = P), overlap, gate.
struct Schedule {
  CpStrategy strategy;
  int world;
  int64_t ulysses;
  bool overlap;
  bool gate;
  std::string name() const {
    return std::string(strategy == CpStrategy::latent_kv_head ? "latent" : "expanded") + "_u" +
           std::to_string(ulysses ? ulysses : world) + "of" + std::to_string(world) +
           (overlap ? "_overlap" : "_plain") + (gate ? "_gate" : "");
  }
};

std::vector<Schedule> schedules() {
  std::vector<Schedule> all;
  for (bool overlap : {false, true}) {
    for (bool gate : {false, true}) all.push_back({CpStrategy::expanded_ulysses, 2, 0, overlap, gate});
    all.push_back({CpStrategy::expanded_ulysses, 4, 2, overlap, false});
    all.push_back({CpStrategy::latent_kv_head, 2, 0, overlap, false});
    all.push_back({CpStrategy::latent_kv_head, 4, 2, overlap, false});
  }
  return all;
}

MlaConfig config_of(const Schedule& s) {
  MlaConfig cfg = preset_config("tiny");
  cfg.output_gate = s.gate;
  return cfg;
}

// A (schedule, tensor) pair: tensor is a parameter name of the module or "hidden".
struct InPlaceCase {
  Schedule schedule;
  std::string tensor;
};

void PrintTo(const InPlaceCase& c, std::ostream* os) { *os << c.schedule.name() << " / " << c.tensor; }

// Every parameter the module has for the schedule's config (o_gate_proj only with the gate), and
// the input. A parameter the path does not read would get no gradient: the clean step asserts it.
std::vector<InPlaceCase> in_place_cases() {
  std::vector<InPlaceCase> cases;
  for (const Schedule& s : schedules()) {
    MlaAttention m(config_of(s), at::TensorOptions().dtype(at::kDouble));
    for (const auto& item : m->named_parameters()) cases.push_back({s, item.key()});
    cases.push_back({s, kHidden});
  }
  return cases;
}

std::map<std::string, at::Tensor> gradients(MlaAttention& m, const at::Tensor& x) {
  std::map<std::string, at::Tensor> out;
  if (x.grad().defined()) out[kHidden] = x.grad().clone();
  for (const auto& item : m->named_parameters())
    if (item.value().grad().defined()) out[item.key()] = item.value().grad().clone();
  return out;
}

void clear_gradients(MlaAttention& m, at::Tensor& x) {
  x.mutable_grad().reset();
  for (auto& p : m->parameters()) p.mutable_grad().reset();
}

void expect_backward_rejects_the_change(int rank, int world, const std::string& store, const InPlaceCase& ic) {
  const Schedule& s = ic.schedule;
  GroupOptions options;
  options.timeout = std::chrono::seconds(30);  // a rank left behind is an error, not a hang
  ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, world, 1, s.ulysses}, options);
  VerifyCase c{"in-place", config_of(s)};
  MlaAttention m = make_case_module(c, at::kDouble);
  parallelize(m, g, {s.strategy, CpPartition::contiguous, s.overlap});
  at::manual_seed(100 + rank);
  at::Tensor x = at::randn({1, 4, c.config.hidden_size}, at::kDouble).requires_grad_(true);
  const at::Tensor dy = at::randn({1, 4, c.config.hidden_size}, at::kDouble);
  at::Tensor target = ic.tensor == kHidden ? x : m->named_parameters()[ic.tensor];

  // A clean step: the path reads the tensor (it gets a gradient) and backward runs without it.
  (m->forward(x) * dy).sum().backward();
  const std::map<std::string, at::Tensor> clean = gradients(m, x);
  ASSERT_TRUE(clean.count(ic.tensor)) << ic.tensor << " gets no gradient on this path: nothing to check";
  clear_gradients(m, x);

  // The same step, with the tensor changed in place between forward and backward.
  at::Tensor y = m->forward(x);
  {
    at::NoGradGuard no_grad;
    target.mul_(1.5).add_(0.25);  // identical on every rank
  }
  std::string message;
  try {
    (y * dy).sum().backward();
  } catch (const std::exception& e) {
    message = e.what();
  }
  barrier(g.world);
  if (message.empty()) {
    // Accepted: say how far the gradients moved from the clean step's (computed from new values).
    double moved = 0.0;
    std::string most;
    for (const auto& [name, grad] : gradients(m, x)) {
      const double d = clean.count(name) ? (grad - clean.at(name)).abs().max().item<double>() : 0.0;
      if (d > moved) {
        moved = d;
        most = name;
      }
    }
    ADD_FAILURE() << "[rank " << rank << "] " << s.name() << ": backward accepted an in-place change of "
                  << ic.tensor << " after the forward; largest gradient change vs. the clean step: " << moved
                  << (most.empty() ? "" : " (grad of " + most + ")");
    return;
  }
  EXPECT_THAT(message, AnyOf(HasSubstr("modified by an inplace operation"),
                             HasSubstr("a tensor saved for backward was modified in place")))
      << "[rank " << rank << "] " << s.name() << " / " << ic.tensor;
}

class InPlaceModification : public ::testing::TestWithParam<InPlaceCase> {};

TEST_P(InPlaceModification, BackwardNamesTheModification) {
  const InPlaceCase ic = GetParam();
  EXPECT_TRUE(test::run_ranks(
      ic.schedule.world,
      [ic](int rank, int world, const std::string& store) { expect_backward_rejects_the_change(rank, world, store, ic); },
      std::chrono::seconds(60)));
}

INSTANTIATE_TEST_SUITE_P(EverySchedule, InPlaceModification, ::testing::ValuesIn(in_place_cases()),
                         [](const ::testing::TestParamInfo<InPlaceCase>& info) {
                           std::string tensor = info.param.tensor;
                           std::replace(tensor.begin(), tensor.end(), '.', '_');
                           return info.param.schedule.name() + "_" + tensor;
                         });

}  // namespace
}  // namespace mlacp
