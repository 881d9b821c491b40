// CpPlan (pure C++): one test per validation rule, the derived values, text/JSON, fingerprints,
// token sharding (contiguous and head_tail) and the expected communication volumes.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/error_of.h"
#include "mlacp/errors.h"
#include "mlacp/plan.h"

namespace mlacp {
namespace {

using test::error_of;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Small valid dims: heads 16, Rq 64, Rkv 32, Dn 16, Dr 8, Dv 12.
PlanDims small_dims() {
  PlanDims d;
  d.heads = 16;
  d.q_rank = 64;
  d.kv_rank = 32;
  d.nope_dim = 16;
  d.rope_dim = 8;
  d.value_dim = 12;
  return d;
}

CpPlanSpec spec(int64_t tp = 1, int64_t cp = 4, int64_t ulysses = 0,
                CpStrategy strategy = CpStrategy::latent_kv_head) {
  CpPlanSpec s;
  s.dims = small_dims();
  s.tp = tp;
  s.cp = cp;
  s.ulysses = ulysses;
  s.strategy = strategy;
  return s;
}

// Expects CpPlan(s) to throw; checks the rule text and every "name=value" part.
void expect_rejected(const CpPlanSpec& s, const std::string& rule, const std::vector<std::string>& parts) {
  const std::string m = error_of([&] { CpPlan plan(s); });
  EXPECT_TRUE(contains(m, "mlacp: CP plan: ")) << m;
  EXPECT_TRUE(contains(m, rule)) << m;
  for (const auto& p : parts) EXPECT_TRUE(contains(m, p)) << "missing '" << p << "' in: " << m;
}

// --- validation ------------------------------------------------------------------------------
TEST(PlanValidation, AcceptsValidSpecs) {
  EXPECT_NO_THROW(CpPlan(spec()));
  EXPECT_NO_THROW(CpPlan(spec(1, 1)));
  EXPECT_NO_THROW(CpPlan(spec(2, 4, 2)));
  EXPECT_NO_THROW(CpPlan(spec(1, 4, 1)));
  EXPECT_NO_THROW(CpPlan(spec(4, 4, 4, CpStrategy::expanded_ulysses)));
  EXPECT_NO_THROW(CpPlan(spec(16, 8, 1)));
}

TEST(PlanValidation, EachDimMustBePositive) {
  struct Case {
    int64_t PlanDims::*field;
    const char* name;
  };
  for (const Case& c : {Case{&PlanDims::heads, "heads"}, Case{&PlanDims::q_rank, "q_rank"},
                        Case{&PlanDims::kv_rank, "kv_rank"}, Case{&PlanDims::nope_dim, "nope_dim"},
                        Case{&PlanDims::rope_dim, "rope_dim"}, Case{&PlanDims::value_dim, "value_dim"}}) {
    for (int64_t bad : {int64_t{0}, int64_t{-2}}) {
      CpPlanSpec s = spec();
      s.dims.*(c.field) = bad;
      expect_rejected(s, std::string(c.name) + " must be > 0", {std::string(c.name) + "=" + std::to_string(bad)});
    }
  }
}

TEST(PlanValidation, RopeDimMustBeEven) {
  CpPlanSpec s = spec();
  s.dims.rope_dim = 7;
  expect_rejected(s, "rope_dim must be even", {"rope_dim=7"});
}

TEST(PlanValidation, DegreesMustBeAtLeastOne) {
  expect_rejected(spec(0, 4), "tp degree must be >= 1", {"tp=0"});
  expect_rejected(spec(-1, 4), "tp degree must be >= 1", {"tp=-1"});
  expect_rejected(spec(1, 0), "cp degree must be >= 1", {"cp=0"});
  expect_rejected(spec(1, -4), "cp degree must be >= 1", {"cp=-4"});
  expect_rejected(spec(1, 4, -1), "ulysses degree must be >= 1", {"ulysses=-1"});
}

TEST(PlanValidation, CpMustBeDivisibleByUlysses) {
  expect_rejected(spec(1, 4, 3), "cp degree must be divisible by the ulysses degree", {"cp=4", "ulysses=3"});
  expect_rejected(spec(1, 4, 8), "cp degree must be divisible by the ulysses degree", {"cp=4", "ulysses=8"});
  expect_rejected(spec(1, 6, 4), "cp degree must be divisible by the ulysses degree", {"cp=6", "ulysses=4"});
}

TEST(PlanValidation, HeadsMustBeDivisibleByTpTimesUlysses) {
  CpPlanSpec s = spec(2, 4, 2);
  s.dims.heads = 6;  // 6 % (2*2) != 0
  expect_rejected(s, "heads must be divisible by tp * ulysses", {"heads=6", "tp=2", "ulysses=2"});
  CpPlanSpec pure = spec(1, 32, 0);  // U = P = 32 > 16 heads
  expect_rejected(pure, "heads must be divisible by tp * ulysses", {"heads=16", "tp=1", "ulysses=32"});
  CpPlanSpec by_tp = spec(3, 1);
  expect_rejected(by_tp, "heads must be divisible by tp * ulysses", {"heads=16", "tp=3", "ulysses=1"});
}

TEST(PlanValidation, UnknownStrategyAndPartitionNames) {
  const std::string s = error_of([] { parse_strategy("ring"); });
  EXPECT_TRUE(contains(s, "strategy must be expanded_ulysses or latent_kv_head")) << s;
  EXPECT_TRUE(contains(s, "strategy=ring")) << s;
  const std::string p = error_of([] { parse_partition("zigzag"); });
  EXPECT_TRUE(contains(p, "partition must be contiguous or head_tail")) << p;
  EXPECT_TRUE(contains(p, "partition=zigzag")) << p;
  EXPECT_TRUE(contains(error_of([] { parse_strategy(""); }), "strategy=")) << "empty name";
  EXPECT_TRUE(contains(error_of([] { parse_partition("Contiguous"); }), "partition=Contiguous"));
}

TEST(PlanNames, RoundTripAndAliases) {
  for (CpStrategy s : {CpStrategy::expanded_ulysses, CpStrategy::latent_kv_head})
    EXPECT_EQ(parse_strategy(strategy_name(s)), s);
  for (CpPartition p : {CpPartition::contiguous, CpPartition::head_tail}) EXPECT_EQ(parse_partition(partition_name(p)), p);
  EXPECT_EQ(strategy_name(CpStrategy::expanded_ulysses), "expanded_ulysses");
  EXPECT_EQ(strategy_name(CpStrategy::latent_kv_head), "latent_kv_head");
  EXPECT_EQ(partition_name(CpPartition::head_tail), "head_tail");
  EXPECT_EQ(parse_strategy("expanded"), CpStrategy::expanded_ulysses);
  EXPECT_EQ(parse_strategy("latent"), CpStrategy::latent_kv_head);
  EXPECT_EQ(parse_partition("head-tail"), CpPartition::head_tail);
}

// --- derived values --------------------------------------------------------------------------
TEST(PlanDerived, HeadsAndGridPositions) {
  CpPlan plan(spec(2, 4, 2));  // heads 16, tp 2 -> H 8; U 2 -> Hc 4; A 2
  EXPECT_EQ(plan.tp(), 2);
  EXPECT_EQ(plan.cp(), 4);
  EXPECT_EQ(plan.ulysses(), 2);
  EXPECT_EQ(plan.all_gather(), 2);
  EXPECT_EQ(plan.local_heads(), 8);
  EXPECT_EQ(plan.head_block_size(), 4);
  const std::vector<int64_t> u{0, 1, 0, 1}, a{0, 0, 1, 1}, begin{0, 4, 0, 4};
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.ulysses_rank(r), u[r]) << r;
    EXPECT_EQ(plan.all_gather_rank(r), a[r]) << r;
    EXPECT_EQ(plan.head_begin(r), begin[r]) << r;
    EXPECT_EQ(plan.all_gather_rank(r) * plan.ulysses() + plan.ulysses_rank(r), r) << "r = a*U + u";
  }
  EXPECT_EQ(plan.dims().qk_dim(), 24);
  EXPECT_EQ(plan.strategy(), CpStrategy::latent_kv_head);
  EXPECT_EQ(plan.partition(), CpPartition::contiguous);
  EXPECT_FALSE(plan.overlap());
}

TEST(PlanDerived, UlyssesZeroMeansP) {
  CpPlan plan(spec(1, 4, 0));
  EXPECT_EQ(plan.ulysses(), 4);
  EXPECT_EQ(plan.spec().ulysses, 4);
  EXPECT_EQ(plan.all_gather(), 1);
  EXPECT_EQ(plan.head_block_size(), 4);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.ulysses_rank(r), r);
    EXPECT_EQ(plan.all_gather_rank(r), 0);
    EXPECT_EQ(plan.head_begin(r), 4 * r);
  }
  CpPlan pure_gather(spec(1, 4, 1));  // U = 1: every rank computes all heads
  EXPECT_EQ(pure_gather.all_gather(), 4);
  EXPECT_EQ(pure_gather.head_block_size(), 16);
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(pure_gather.head_begin(r), 0);
  CpPlan no_cp(spec(1, 1, 0));
  EXPECT_EQ(no_cp.ulysses(), 1);
  EXPECT_EQ(no_cp.all_gather(), 1);
}

// --- text and JSON ---------------------------------------------------------------------------
TEST(PlanText, TextNamesEveryField) {
  CpPlanSpec s = spec(2, 4, 2, CpStrategy::expanded_ulysses);
  s.overlap = true;
  s.partition = CpPartition::head_tail;
  const std::string text = CpPlan(s).to_text();
  for (const std::string part :
       {"strategy=expanded_ulysses", "partition=head_tail", "overlap=on", "tp=2", "cp(P)=4", "ulysses(U)=2",
        "all_gather(A)=2", "heads=16", "Rq=64", "Rkv=32", "Dn=16", "Dr=8", "Dv=12", "local(H)=8", "head block(Hc)=4"})
    EXPECT_TRUE(contains(text, part)) << "missing '" << part << "' in:\n" << text;
  EXPECT_TRUE(contains(CpPlan(spec()).to_text(), "overlap=off"));
  EXPECT_TRUE(contains(CpPlan(spec()).to_text(), "strategy=latent_kv_head"));
}

TEST(PlanText, JsonHoldsEveryFieldAndDerivedValue) {
  CpPlanSpec s = spec(2, 4, 2, CpStrategy::expanded_ulysses);
  s.overlap = true;
  s.partition = CpPartition::head_tail;
  const nlohmann::json j = nlohmann::json::parse(CpPlan(s).to_json());
  EXPECT_EQ(j.at("dims").at("heads"), 16);
  EXPECT_EQ(j.at("dims").at("q_rank"), 64);
  EXPECT_EQ(j.at("dims").at("kv_rank"), 32);
  EXPECT_EQ(j.at("dims").at("nope_dim"), 16);
  EXPECT_EQ(j.at("dims").at("rope_dim"), 8);
  EXPECT_EQ(j.at("dims").at("value_dim"), 12);
  EXPECT_EQ(j.at("tp"), 2);
  EXPECT_EQ(j.at("cp"), 4);
  EXPECT_EQ(j.at("ulysses"), 2);
  EXPECT_EQ(j.at("all_gather"), 2);
  EXPECT_EQ(j.at("strategy"), "expanded_ulysses");
  EXPECT_EQ(j.at("overlap"), true);
  EXPECT_EQ(j.at("partition"), "head_tail");
  EXPECT_EQ(j.at("local_heads"), 8);
  EXPECT_EQ(j.at("head_block_size"), 4);
  // U = 0 is stored resolved.
  EXPECT_EQ(nlohmann::json::parse(CpPlan(spec(1, 4, 0)).to_json()).at("ulysses"), 4);
}

// --- fingerprint -----------------------------------------------------------------------------
TEST(PlanFingerprint, EqualPlansHaveEqualFingerprints) {
  EXPECT_EQ(CpPlan(spec(2, 4, 2)).fingerprint(), CpPlan(spec(2, 4, 2)).fingerprint());
  EXPECT_EQ(CpPlan(spec(1, 4, 0)).fingerprint(), CpPlan(spec(1, 4, 4)).fingerprint()) << "U=0 is U=P";
  EXPECT_EQ(CpPlan(spec()).to_json(), CpPlan(spec()).to_json());
}

TEST(PlanFingerprint, AnyFieldChangesTheFingerprint) {
  const CpPlanSpec base = spec(2, 4, 2);
  std::vector<std::pair<std::string, std::function<void(CpPlanSpec&)>>> changes{
      {"heads", [](CpPlanSpec& s) { s.dims.heads = 32; }},
      {"q_rank", [](CpPlanSpec& s) { s.dims.q_rank = 65; }},
      {"kv_rank", [](CpPlanSpec& s) { s.dims.kv_rank = 33; }},
      {"nope_dim", [](CpPlanSpec& s) { s.dims.nope_dim = 17; }},
      {"rope_dim", [](CpPlanSpec& s) { s.dims.rope_dim = 10; }},
      {"value_dim", [](CpPlanSpec& s) { s.dims.value_dim = 13; }},
      {"tp", [](CpPlanSpec& s) { s.tp = 4; }},
      {"cp", [](CpPlanSpec& s) { s.cp = 8; }},
      {"ulysses", [](CpPlanSpec& s) { s.ulysses = 4; }},
      {"strategy", [](CpPlanSpec& s) { s.strategy = CpStrategy::expanded_ulysses; }},
      {"overlap", [](CpPlanSpec& s) { s.overlap = true; }},
      {"partition", [](CpPlanSpec& s) { s.partition = CpPartition::head_tail; }},
  };
  const uint64_t reference = CpPlan(base).fingerprint();
  std::set<uint64_t> seen{reference};
  for (auto& [name, change] : changes) {
    CpPlanSpec s = base;
    change(s);
    const uint64_t f = CpPlan(s).fingerprint();
    EXPECT_NE(f, reference) << name;
    EXPECT_TRUE(seen.insert(f).second) << name << " collides with another variant";
  }
}

// --- sharding --------------------------------------------------------------------------------
std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

TEST(PlanSharding, ContiguousBlocks) {
  EXPECT_EQ(shard_token_indices(CpPartition::contiguous, 16, 4, 0), range(0, 4));
  EXPECT_EQ(shard_token_indices(CpPartition::contiguous, 16, 4, 1), range(4, 8));
  EXPECT_EQ(shard_token_indices(CpPartition::contiguous, 16, 4, 3), range(12, 16));
  EXPECT_EQ(shard_token_indices(CpPartition::contiguous, 7, 1, 0), range(0, 7));
}

TEST(PlanSharding, HeadTailChunks) {
  EXPECT_EQ(shard_token_indices(CpPartition::head_tail, 16, 4, 0), (std::vector<int64_t>{0, 1, 14, 15}));
  EXPECT_EQ(shard_token_indices(CpPartition::head_tail, 16, 4, 1), (std::vector<int64_t>{2, 3, 12, 13}));
  EXPECT_EQ(shard_token_indices(CpPartition::head_tail, 16, 4, 2), (std::vector<int64_t>{4, 5, 10, 11}));
  EXPECT_EQ(shard_token_indices(CpPartition::head_tail, 16, 4, 3), (std::vector<int64_t>{6, 7, 8, 9}));
  EXPECT_EQ(shard_token_indices(CpPartition::head_tail, 8, 2, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(shard_token_indices(CpPartition::head_tail, 2, 1, 0), (std::vector<int64_t>{0, 1}));
}

TEST(PlanSharding, ShardsOfAllRanksPartitionTheSequence) {
  for (CpPartition partition : {CpPartition::contiguous, CpPartition::head_tail}) {
    for (int64_t p : {1, 2, 3, 4, 8}) {
      for (int64_t mult : {1, 2, 5}) {
        const int64_t s = 2 * p * mult;
        std::vector<int64_t> all;
        for (int64_t r = 0; r < p; ++r) {
          std::vector<int64_t> mine = shard_token_indices(partition, s, p, r);
          EXPECT_EQ(static_cast<int64_t>(mine.size()), s / p);
          EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end()));
          all.insert(all.end(), mine.begin(), mine.end());
        }
        std::sort(all.begin(), all.end());
        EXPECT_EQ(all, range(0, s)) << partition_name(partition) << " S=" << s << " P=" << p;
      }
    }
  }
}

TEST(PlanSharding, CheckShardableErrorsNameTheValues) {
  EXPECT_NO_THROW(check_shardable(CpPartition::contiguous, 12, 4));
  EXPECT_NO_THROW(check_shardable(CpPartition::head_tail, 16, 4));
  const std::string c = error_of([] { check_shardable(CpPartition::contiguous, 10, 4); });
  EXPECT_TRUE(contains(c, "divisible by P (contiguous)")) << c;
  for (const char* part : {"seq_len=10", "cp=4", "partition=contiguous", "multiple of 4"})
    EXPECT_TRUE(contains(c, part)) << c;
  const std::string h = error_of([] { check_shardable(CpPartition::head_tail, 12, 4); });
  EXPECT_TRUE(contains(h, "divisible by 2P (head_tail)")) << h;
  for (const char* part : {"seq_len=12", "cp=4", "partition=head_tail", "multiple of 8"})
    EXPECT_TRUE(contains(h, part)) << h;
  const std::string zero = error_of([] { check_shardable(CpPartition::contiguous, 0, 4); });
  EXPECT_TRUE(contains(zero, "seq_len=0")) << zero;
  const std::string negative = error_of([] { check_shardable(CpPartition::head_tail, -8, 2); });
  EXPECT_TRUE(contains(negative, "seq_len=-8")) << negative;
  const std::string via = error_of([] { shard_token_indices(CpPartition::head_tail, 12, 4, 0); });
  EXPECT_TRUE(contains(via, "seq_len=12")) << via;
}

TEST(PlanSharding, NonPositiveCpIsAnError) {
  const std::string m = error_of([] { check_shardable(CpPartition::contiguous, 16, 0); });
  EXPECT_TRUE(contains(m, "cp=0")) << m;
}

TEST(PlanSharding, CpRankOutOfRangeIsAnError) {
  EXPECT_FALSE(error_of([] { shard_token_indices(CpPartition::contiguous, 16, 4, 4); }).empty());
  EXPECT_FALSE(error_of([] { shard_token_indices(CpPartition::head_tail, 16, 4, -1); }).empty());
}

// --- expected communication ------------------------------------------------------------------
// dims: H 16, Dn 16, Dr 8 (qk 24), Dv 12, Rkv 32. B 2, S 64, P 4 -> T = B*S/P = 32 tokens/rank.
TEST(PlanComm, LatentPureUlysses) {
  CpPlan plan(spec(1, 4, 0, CpStrategy::latent_kv_head));  // A = 1, U = 4
  const CommVolume v = expected_comm_elements(plan, 2, 64);
  const int64_t T = 32, H = 16, qk = 24, Dv = 12, Rkv = 32, Dr = 8, P = 4, U = 4;
  EXPECT_EQ(v.forward_all_to_all, T * H * qk * (U - 1) / U);  // Q seq->head: 9216
  EXPECT_EQ(v.forward_all_to_all, 9216);
  EXPECT_EQ(v.forward_all_gather, (P - 1) * T * (Rkv + Dr));  // latent + rope key: 3840
  EXPECT_EQ(v.forward_all_gather, 3840);
  EXPECT_EQ(v.forward_output, T * H * Dv * (U - 1) / U);  // O head->seq: 4608
  EXPECT_EQ(v.forward_output, 4608);
  EXPECT_EQ(v.backward_all_to_all, 4608 + 9216);
  EXPECT_EQ(v.backward_reduce, 3840);
}

TEST(PlanComm, LatentHybridGathersTheLatentFromAllRanks) {
  CpPlan plan(spec(1, 4, 2, CpStrategy::latent_kv_head));  // A = 2, U = 2
  const CommVolume v = expected_comm_elements(plan, 2, 64);
  EXPECT_EQ(v.forward_all_to_all, 32 * 16 * 24 / 2);  // 6144
  EXPECT_EQ(v.forward_all_gather, 3 * 32 * 40);       // still (P-1)*T*(Rkv+Dr)
  EXPECT_EQ(v.forward_output, 32 * 16 * 12 / 2);      // 3072
  EXPECT_EQ(v.backward_all_to_all, 3072 + 6144);
  EXPECT_EQ(v.backward_reduce, 3840);
}

TEST(PlanComm, ExpandedPureUlyssesGathersNothing) {
  CpPlan plan(spec(1, 4, 0, CpStrategy::expanded_ulysses));
  const CommVolume v = expected_comm_elements(plan, 2, 64);
  EXPECT_EQ(v.forward_all_to_all, 32 * 16 * (2 * 24 + 12) * 3 / 4);  // Q, K, V: 23040
  EXPECT_EQ(v.forward_all_gather, 0);
  EXPECT_EQ(v.forward_output, 4608);
  EXPECT_EQ(v.backward_all_to_all, 4608 + 23040);
  EXPECT_EQ(v.backward_reduce, 0);
}

TEST(PlanComm, ExpandedHybridGathersKeysAndValues) {
  CpPlan plan(spec(1, 4, 2, CpStrategy::expanded_ulysses));  // A = 2, U = 2
  const CommVolume v = expected_comm_elements(plan, 2, 64);
  EXPECT_EQ(v.forward_all_to_all, 32 * 16 * 60 / 2);         // 15360
  EXPECT_EQ(v.forward_all_gather, (2 - 1) * 32 * 16 * (24 + 12));  // (A-1)*T*H*(qk+Dv) = 18432
  EXPECT_EQ(v.forward_output, 3072);
  EXPECT_EQ(v.backward_all_to_all, 3072 + 15360);
  EXPECT_EQ(v.backward_reduce, 18432);
  // Pure all-gather (U = 1): no all-to-all at all.
  const CommVolume g = expected_comm_elements(CpPlan(spec(1, 4, 1, CpStrategy::expanded_ulysses)), 2, 64);
  EXPECT_EQ(g.forward_all_to_all, 0);
  EXPECT_EQ(g.forward_output, 0);
  EXPECT_EQ(g.forward_all_gather, 3 * 32 * 16 * 36);
}

TEST(PlanComm, TensorParallelShrinksPerHeadVolumesOnly) {
  CpPlan plan(spec(2, 4, 0, CpStrategy::latent_kv_head));  // H = 8
  const CommVolume v = expected_comm_elements(plan, 2, 64);
  EXPECT_EQ(v.forward_all_to_all, 32 * 8 * 24 * 3 / 4);
  EXPECT_EQ(v.forward_all_gather, 3840);
  EXPECT_EQ(v.forward_output, 32 * 8 * 12 * 3 / 4);
}

TEST(PlanComm, NoCpMovesNothing) {
  for (CpStrategy s : {CpStrategy::latent_kv_head, CpStrategy::expanded_ulysses}) {
    const CommVolume v = expected_comm_elements(CpPlan(spec(1, 1, 0, s)), 2, 64);
    EXPECT_EQ(v.forward_all_to_all, 0);
    EXPECT_EQ(v.forward_all_gather, 0);
    EXPECT_EQ(v.forward_output, 0);
    EXPECT_EQ(v.backward_all_to_all, 0);
    EXPECT_EQ(v.backward_reduce, 0);
  }
}

TEST(PlanComm, DeepSeekV3SizedLatentBeatsExpandedOnTheGather) {
  // DeepSeek-V3 attention dims: 128 heads, Rq 1536, Rkv 512, Dn 128, Dr 64, Dv 128.
  CpPlanSpec s;
  s.dims = PlanDims{128, 1536, 512, 128, 64, 128};
  s.cp = 8;
  s.ulysses = 2;
  s.strategy = CpStrategy::latent_kv_head;
  const CommVolume latent = expected_comm_elements(CpPlan(s), 1, 8192);
  s.strategy = CpStrategy::expanded_ulysses;
  const CommVolume expanded = expected_comm_elements(CpPlan(s), 1, 8192);
  const int64_t T = 1024;
  EXPECT_EQ(latent.forward_all_gather, 7 * T * 576);
  EXPECT_EQ(expanded.forward_all_gather, 3 * T * 128 * (192 + 128));
  EXPECT_LT(latent.forward_all_gather, expanded.forward_all_gather);
}

}  // namespace
}  // namespace mlacp
