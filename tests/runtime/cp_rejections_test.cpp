// Every CP rejection rule fires before any collective, on every rank alike (docs/DESIGN.md §6, §8).
// "Before any collective" is shown by calling the bad forward on rank 0 only while rank 1 makes
// no call at all: a collective would block until the timeout; the error must come at once.
#include <chrono>
#include <functional>
#include <map>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "check/cases.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "support/multiprocess.h"

namespace mlacp {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

struct Installed {
  ParallelGroups groups;
  MlaAttention module{nullptr};
};

Installed install(int rank, int world, const std::string& store, CpPartition partition, bool gate = false) {
  GroupOptions options;
  options.timeout = std::chrono::seconds(20);
  Installed out{test::make_groups(rank, world, store, MeshShape{1, world, 1, 0}, options)};
  VerifyCase c{"rejections", preset_config("tiny")};
  c.config.output_gate = gate;
  out.module = make_case_module(c, at::kDouble);
  parallelize(out.module, out.groups, {CpStrategy::latent_kv_head, partition, /*overlap=*/false});
  return out;
}

// A rejection case: the local hidden and options of a bad call, and what the message must name.
struct BadCall {
  std::string name;
  std::function<void(MlaAttention&, int64_t world)> call;
  std::vector<std::string> message_parts;
  CpPartition partition = CpPartition::contiguous;
};

at::Tensor local_hidden(int64_t local_len, int64_t batch = 1, int64_t width = 12) {
  return at::randn({batch, local_len, width}, at::kDouble);
}

std::vector<BadCall> bad_calls() {
  std::vector<BadCall> calls;
  calls.push_back({"head_tail needs 2P | S", [](MlaAttention& m, int64_t) { m->forward(local_hidden(3)); },
                   {"divisible by 2P", "seq_len=6"}, CpPartition::head_tail});
  calls.push_back({"hidden not 3-D", [](MlaAttention& m, int64_t) { m->forward(at::randn({4, 12}, at::kDouble)); },
                   {"3-D", "shape=[4, 12]"}});
  calls.push_back({"hidden size", [](MlaAttention& m, int64_t) { m->forward(local_hidden(4, 1, 10)); },
                   {"hidden_size", "hidden.size(-1)=10"}});
  calls.push_back({"hidden on another device than the module",
                   [](MlaAttention& m, int64_t) {
                     m->forward(at::empty({1, 4, 12}, at::TensorOptions().dtype(at::kDouble).device(at::kMeta)));
                   },
                   {"module's device", "hidden.device=meta", "module.device=cpu"}});
  calls.push_back({"document ends not at the global token count",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.document_ends = std::vector<int64_t>{3, 4};  // local count, not global 8
                     m->forward(local_hidden(4), o);
                   },
                   {"must end at the token count", "tokens=8"}});
  calls.push_back({"packed with batch > 1",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.document_ends = std::vector<int64_t>{3, 8};
                     m->forward(local_hidden(4, 2), o);
                   },
                   {"batch 1", "batch=2"}});
  calls.push_back({"query/key documents differ",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.document_ends = std::vector<int64_t>{3, 8};
                     o.key_document_ends = std::vector<int64_t>{5, 8};
                     m->forward(local_hidden(4), o);
                   },
                   {"identical", "key_document_ends=[5, 8]"}});
  calls.push_back({"mask of the local length",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.attention_mask = at::ones({4, 4}, at::kBool);
                     m->forward(local_hidden(4), o);
                   },
                   {"[S, S]", "S=8"}});
  calls.push_back({"additive mask",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.attention_mask = at::zeros({8, 8}, at::kDouble);
                     m->forward(local_hidden(4), o);
                   },
                   {"boolean", "mask.dtype=float64"}});
  calls.push_back({"mask with packing",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.attention_mask = at::ones({8, 8}, at::kBool);
                     o.document_ends = std::vector<int64_t>{8};
                     m->forward(local_hidden(4), o);
                   },
                   {"mutually exclusive"}});
  calls.push_back({"dropout in training",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.dropout = 0.1;
                     m->train();
                     m->forward(local_hidden(4), o);
                   },
                   {"dropout must be 0", "dropout=0.1"}});
  calls.push_back({"KV cache",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.use_cache = true;
                     m->forward(local_hidden(4), o);
                   },
                   {"KV cache", "use_cache=true"}});
  calls.push_back({"attention weights",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.output_attentions = true;
                     m->forward(local_hidden(4), o);
                   },
                   {"attention weights", "output_attentions=true"}});
  calls.push_back({"global position ids instead of the shard's",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.position_ids = at::arange(8, at::kLong);
                     m->forward(local_hidden(4), o);
                   },
                   {"position_ids must be [S] or [B|1, S]", "position_ids.shape=[8]"}});
  calls.push_back({"non-bool is_causal through an integer position tensor",
                   [](MlaAttention& m, int64_t) {
                     MlaForwardOptions o;
                     o.position_ids = at::arange(4, at::kDouble);
                     m->forward(local_hidden(4), o);
                   },
                   {"integer", "dtype=float64"}});
  return calls;
}

class CpRejection : public ::testing::TestWithParam<int> {};

TEST_P(CpRejection, FiresBeforeAnyCollectiveOnEveryRankAlike) {
  const BadCall bad = bad_calls()[GetParam()];
  SCOPED_TRACE(bad.name);
  EXPECT_TRUE(test::run_ranks(2, [&](int rank, int world, const std::string& store) {
    Installed s = install(rank, world, store, bad.partition);
    auto expect_rejected = [&] {
      const auto start = Clock::now();
      try {
        bad.call(s.module, world);
        ADD_FAILURE() << bad.name << ": nothing was thrown on rank " << rank;
      } catch (const Error& e) {
        for (const auto& part : bad.message_parts) EXPECT_THAT(e.what(), HasSubstr(part)) << "rank " << rank;
      }
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0) << "rank " << rank;
    };
    // Rank 0 alone: no peer takes part, so a collective would block.
    if (rank == 0) expect_rejected();
    barrier(s.groups.world);
    // Every rank alike.
    expect_rejected();
    barrier(s.groups.world);
  }));
}

INSTANTIATE_TEST_SUITE_P(AllRules, CpRejection, ::testing::Range(0, static_cast<int>(bad_calls().size())));

TEST(CpInstall, RejectsInstallingTwiceAndKeepsTheParameters) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups groups = test::make_groups(rank, world, store, MeshShape{1, 2, 1, 0}, options);
    MlaConfig c = preset_config("tiny");
    MlaAttention m(c, at::TensorOptions().dtype(at::kDouble));
    std::vector<at::Tensor> before;
    for (const auto& p : m->parameters()) before.push_back(p);
    const CpPlan plan(plan_spec_for(c, groups.shape, CpStrategy::expanded_ulysses, CpPartition::contiguous, false));
    install_context_parallel(m, plan, groups);
    const auto after = m->parameters();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].is_same(before[i]));
    try {
      install_context_parallel(m, plan, groups);
      ADD_FAILURE() << "second install accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("already installed"));
    }
    // Gradients land in the original parameter objects.
    m->forward(at::randn({1, 4, 12}, at::kDouble)).sum().backward();
    for (const auto& p : before) EXPECT_TRUE(p.grad().defined());
  }));
}

TEST(CpInstall, RejectsGroupsOnAnotherDeviceThanTheModule) {
  // CPU (Gloo) groups and a module elsewhere: rejected at install, before the fingerprints cross.
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups groups = test::make_groups(rank, world, store, MeshShape{1, 2, 1, 0}, options);
    MlaAttention m(preset_config("tiny"), at::TensorOptions().dtype(at::kDouble));
    std::map<std::string, at::Tensor> elsewhere;  // the module's parameters on another device
    for (const auto& item : m->named_parameters())
      elsewhere[item.key()] = at::empty(item.value().sizes(), item.value().options().device(at::kMeta));
    m->adopt_parameters(elsewhere);
    const auto start = Clock::now();
    try {
      if (rank == 0) parallelize(m, groups, {CpStrategy::latent_kv_head, CpPartition::contiguous, false});
      if (rank == 0) ADD_FAILURE() << "groups on another device were accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("must move tensors on the module's device"));
      EXPECT_THAT(e.what(), HasSubstr("group.backend=gloo"));
      EXPECT_THAT(e.what(), HasSubstr("module.device=meta"));
    }
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);  // no collective reached
    barrier(groups.world);
  }));
}

TEST(CpInstall, RejectsMismatchedDegreesDimsAndUnshardedProjections) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups groups = test::make_groups(rank, world, store, MeshShape{1, 1, 2, 0}, options);  // tp = 2
    MlaConfig c = preset_config("tiny");
    auto expect_error = [&](const std::function<void()>& f, const std::vector<std::string>& parts) {
      try {
        f();
        ADD_FAILURE() << "accepted";
      } catch (const Error& e) {
        for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
      }
    };
    // TP-wrong projection shapes: the module was not sharded.
    expect_error([&] {
      MlaAttention m(c, at::TensorOptions().dtype(at::kDouble));
      CpPlan plan(plan_spec_for(c, groups.shape, CpStrategy::latent_kv_head, CpPartition::contiguous, false));
      install_context_parallel(m, plan, groups);
    }, {"apply TP sharding first", "q_b_proj.weight.shape=[20, 5]", "expected rows=10"});
    // Plan degree differs from the group size.
    expect_error([&] {
      MlaAttention m(c, at::TensorOptions().dtype(at::kDouble));
      m->shard_heads_for_tp(groups.tp_rank, 2);
      MeshShape other{1, 1, 4, 0};
      CpPlan plan(plan_spec_for(c, other, CpStrategy::latent_kv_head, CpPartition::contiguous, false));
      install_context_parallel(m, plan, groups);
    }, {"tp group size must equal the plan's degree", "tp_group_size=2", "plan.tp=4"});
    // Plan dims differ from the module's config.
    expect_error([&] {
      MlaAttention m(c, at::TensorOptions().dtype(at::kDouble));
      m->shard_heads_for_tp(groups.tp_rank, 2);
      MlaConfig other = c;
      other.kv_lora_rank = 8;
      CpPlan plan(plan_spec_for(other, groups.shape, CpStrategy::latent_kv_head, CpPartition::contiguous, false));
      install_context_parallel(m, plan, groups);
    }, {"plan dims must match", "kv_lora_rank=6"});
    barrier(groups.world);
  }));
}

TEST(CpInstall, ParallelizeShardsHeadsForTpOnceAndRejectsAnotherSharding) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups groups = test::make_groups(rank, world, store, MeshShape{1, 1, 2, 0}, options);  // tp = 2
    MlaConfig c = preset_config("tiny");
    MlaAttention m(c, at::TensorOptions().dtype(at::kDouble));
    const int64_t rows = m->kv_b_proj->weight.size(0);
    const CpPlan plan = parallelize(m, groups, {CpStrategy::latent_kv_head, CpPartition::contiguous, false});
    EXPECT_EQ(m->tp_size(), 2);
    EXPECT_EQ(m->kv_b_proj->weight.size(0), rows / 2);
    EXPECT_EQ(plan.tp(), 2);
    EXPECT_TRUE(m->is_parallel());
    MlaAttention other(c, at::TensorOptions().dtype(at::kDouble));
    other->shard_heads_for_tp(0, 4);  // sharded for another degree: rejected before any collective
    try {
      parallelize(other, groups, {});
      ADD_FAILURE() << "a module sharded for tp=4 was accepted by tp=2 groups";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("module.tp_size=4"));
      EXPECT_THAT(e.what(), HasSubstr("groups.tp=2"));
    }
    barrier(groups.world);
  }));
}

TEST(CpInstall, DifferentPlansAcrossRanksAreAnErrorOnEveryRank) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups groups = test::make_groups(rank, world, store, MeshShape{1, 2, 1, 0}, options);
    MlaConfig c = preset_config("tiny");
    MlaAttention m(c, at::TensorOptions().dtype(at::kDouble));
    const CpStrategy strategy = rank == 0 ? CpStrategy::latent_kv_head : CpStrategy::expanded_ulysses;
    CpPlan plan(plan_spec_for(c, groups.shape, strategy, CpPartition::contiguous, false));
    try {
      install_context_parallel(m, plan, groups);
      ADD_FAILURE() << "mismatched plans accepted on rank " << rank;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("plan fingerprints differ across the CP group"));
    }
    EXPECT_FALSE(m->is_parallel());
  }));
}

}  // namespace
}  // namespace mlacp
