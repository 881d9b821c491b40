#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "support/multiprocess.h"

namespace mlacp {
namespace {

TEST(Sharding, ShardAndUnshardRoundTripForBothPartitions) {
  at::Tensor global = at::arange(2 * 16 * 3, at::kDouble).view({2, 16, 3});
  for (CpPartition p : {CpPartition::contiguous, CpPartition::head_tail}) {
    std::vector<at::Tensor> shards;
    for (int64_t r = 0; r < 4; ++r) shards.push_back(shard_sequence(global, p, 4, r));
    EXPECT_TRUE(at::equal(unshard_sequence(shards, p), global)) << partition_name(p);
  }
  // head_tail rank 1 of 4 on 16 tokens holds chunks 1 and 6: tokens 2, 3, 12, 13.
  at::Tensor tokens = at::arange(16, at::kLong).view({1, 16});
  EXPECT_TRUE(at::equal(shard_sequence(tokens, CpPartition::head_tail, 4, 1), at::tensor({2, 3, 12, 13}).view({1, 4})));
}

TEST(Sharding, LocalDocumentEndsCutAtShardBoundaries) {
  // Documents [0,3) [3,73) [73,129) [129,256), P = 4 contiguous: rank 1 holds [64,128).
  EXPECT_EQ(shard_document_ends({3, 73, 129, 256}, CpPartition::contiguous, 256, 4, 1),
            (std::vector<int64_t>{9, 64}));
  // head_tail rank 0 holds [0,32) and [224,256): documents [0,3), [3,32) | [224,256).
  EXPECT_EQ(shard_document_ends({3, 73, 129, 256}, CpPartition::head_tail, 256, 4, 0),
            (std::vector<int64_t>{3, 32, 64}));
}

TEST(Sharding, GatherSequenceRebuildsTheGlobalTensorOnEveryRank) {
  EXPECT_TRUE(test::run_ranks(4, [](int rank, int world, const std::string& store) {
    ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, 4, 1, 0});
    at::Tensor global = at::arange(2 * 16 * 3, at::kFloat).view({2, 16, 3});
    for (CpPartition p : {CpPartition::contiguous, CpPartition::head_tail}) {
      at::Tensor local = shard_sequence(global, p, 4, g.cp_rank);
      EXPECT_TRUE(at::equal(gather_sequence(g.cp, local, p), global));
    }
  }));
}

TEST(GradientReduction, DisagreeingFrozenSetsAreAnErrorNotAHang) {
  EXPECT_TRUE(test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(20);
    ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, 2, 1, 0}, options);
    MlaAttention m(preset_config("tiny"), at::TensorOptions().dtype(at::kDouble));
    if (rank == 1) m->o_proj->weight.set_requires_grad(false);
    m->forward(at::randn({1, 4, 12}, at::kDouble)).sum().backward();
    try {
      reduce_gradients(m->named_parameters(), g);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("disagree on which parameters have gradients"));
    }
  }));
}

TEST(GradientReduction, SumsOverCpAndReplicatedParametersOverTp) {
  EXPECT_TRUE(test::run_ranks(4, [](int rank, int world, const std::string& store) {
    ParallelGroups g = test::make_groups(rank, world, store, MeshShape{1, 2, 2, 0});
    torch::OrderedDict<std::string, at::Tensor> params;
    at::Tensor sharded = at::zeros({2}, at::kDouble).requires_grad_(true);
    at::Tensor replicated = at::zeros({2}, at::kDouble).requires_grad_(true);
    sharded.mutable_grad() = at::full({2}, 1.0 + rank, at::kDouble);
    replicated.mutable_grad() = at::full({2}, 1.0 + rank, at::kDouble);
    params.insert("kv_b_proj.weight", sharded);
    params.insert("q_a_proj.weight", replicated);
    reduce_gradients(params, g);
    // world rank = cp_rank * 2 + tp_rank; CP group of rank r: {tp_rank, tp_rank + 2}.
    const double cp_sum = (1.0 + g.tp_rank) + (3.0 + g.tp_rank);
    EXPECT_EQ(sharded.grad()[0].item<double>(), cp_sum);
    EXPECT_EQ(replicated.grad()[0].item<double>(), 1.0 + 2.0 + 3.0 + 4.0);
  }));
}

}  // namespace
}  // namespace mlacp
