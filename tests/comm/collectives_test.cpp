// The communication layer's collectives, across real processes (Gloo over a FileStore): every
// collective is fed rank-tagged inputs whose values encode (source rank, batch, token, head,
// lane) as rank*1e6 + b*1e4 + t*100 + h*10 + d, so the exact placement of every element can be
// checked against a formula that does not share the library's reshapes. World sizes 2 and 4.
#include <sys/resource.h>
#include <time.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "mlacp/comm.h"
#include "mlacp/errors.h"
#include "support/multiprocess.h"

namespace mlacp {
namespace {

using test::make_groups;
using test::run_ranks;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::seconds kRunTimeout{60};

GroupOptions fast_options() {
  GroupOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  return options;
}

// arange(n) as float64, laid along `dim` of an `ndim`-dim tensor (size 1 elsewhere).
at::Tensor axis(int64_t n, int64_t dim, int64_t ndim) {
  std::vector<int64_t> shape(ndim, 1);
  shape[dim] = n;
  return at::arange(n, at::kDouble).view(shape);
}

// The tag formula on broadcastable index tensors (float64).
at::Tensor tag(const at::Tensor& src, const at::Tensor& b, const at::Tensor& t, const at::Tensor& h,
               const at::Tensor& d) {
  return src * 1e6 + b * 1e4 + t * 100 + h * 10 + d;
}

// x[b, t, h, d] = tag(rank, b, t, h, d), shape [B, S, H, D], float32 (exact: values < 2^24).
at::Tensor tagged(int64_t rank, int64_t B, int64_t S, int64_t H, int64_t D,
                  at::ScalarType dtype = at::kFloat) {
  at::Tensor src = at::full({1, 1, 1, 1}, static_cast<double>(rank), at::kDouble);
  return tag(src, axis(B, 0, 4), axis(S, 1, 4), axis(H, 2, 4), axis(D, 3, 4)).to(dtype);
}

// Deterministic random input of `rank` (any rank can rebuild any other rank's input).
at::Tensor random_input(int64_t rank, at::IntArrayRef shape, at::ScalarType dtype) {
  at::manual_seed(1000 + rank);
  return at::randn(shape, at::kDouble).to(dtype);
}

// Bit-exact comparison (16-bit floats compared as their bit patterns).
bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.element_size() == 2) return at::equal(a.contiguous().view(at::kShort), b.contiguous().view(at::kShort));
  return at::equal(a, b);
}

// Expected seq->head result on group rank `me` of a group whose member g has world rank
// members[g]: out[b, g*S_l + t, j, d] = tag(members[g], b, t, me*Hc + j, d).
at::Tensor expected_seq_to_head(const std::vector<int64_t>& members, int64_t me, int64_t B, int64_t S_l, int64_t H,
                                int64_t D) {
  const int64_t G = static_cast<int64_t>(members.size()), Hc = H / G;
  at::Tensor T = axis(G * S_l, 1, 4);
  at::Tensor src = at::tensor(members, at::kLong).to(at::kDouble).index({at::floor_divide(T, S_l).to(at::kLong)});
  at::Tensor t = at::remainder(T, S_l);
  at::Tensor h = axis(Hc, 2, 4) + static_cast<double>(me * Hc);
  return tag(src, axis(B, 0, 4), t, h, axis(D, 3, 4)).to(at::kFloat);
}

std::vector<int64_t> iota(int64_t n, int64_t start = 0, int64_t step = 1) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(start + i * step);
  return v;
}

class Collectives : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
};

// Small sizes: t < 100, h < 10, d < 10 keep the tag fields apart. H divisible by 2 and 4.
constexpr int64_t kB = 2, kS = 3, kH = 8, kD = 3;

// --- Ulysses exchanges -----------------------------------------------------------------------
TEST_P(Collectives, SeqToHeadPlacesTokensInSourceRankOrderWithThisRanksHeadBlock) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    for (const CommGroup* group : {&groups.cp, &groups.ulysses}) {
      ASSERT_EQ(group->size(), world);
      ASSERT_EQ(group->rank(), rank);
      at::Tensor x = tagged(rank, kB, kS, kH, kD);
      at::Tensor out = launch_seq_to_head(*group, x, "q").wait_one();
      ASSERT_EQ(out.sizes(), (std::vector<int64_t>{kB, world * kS, kH / world, kD}));
      EXPECT_TRUE(at::equal(out, expected_seq_to_head(iota(world), rank, kB, kS, kH, kD)))
          << group->name() << " rank " << rank;
      EXPECT_TRUE(at::equal(x, tagged(rank, kB, kS, kH, kD))) << "the input must not be modified";
    }
  }, kRunTimeout));
}

TEST_P(Collectives, HeadToSeqPlacesHeadBlocksInSourceRankOrder) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world, Hc = kH / G;
    // y on rank r: [B, G*S_l, Hc, D], y[b, T, j, d] = tag(r, b, T, j, d).
    at::Tensor y = tagged(rank, kB, G * kS, Hc, kD);
    at::Tensor out = launch_head_to_seq(groups.cp, y, "o").wait_one();
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{kB, kS, G * Hc, kD}));
    // out[b, t, hh, d] = y_{hh / Hc}[b, rank*S_l + t, hh % Hc, d]
    at::Tensor hh = axis(G * Hc, 2, 4);
    at::Tensor expected = tag(at::floor_divide(hh, Hc), axis(kB, 0, 4), axis(kS, 1, 4) + double(rank * kS),
                              at::remainder(hh, Hc), axis(kD, 3, 4))
                              .to(at::kFloat);
    EXPECT_TRUE(at::equal(out, expected));
  }, kRunTimeout));
}

TEST_P(Collectives, HeadToSeqIsTheExactInverseOfSeqToHead) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      at::Tensor x = random_input(rank, {kB, kS, kH, 5}, dtype);
      at::Tensor heads = launch_seq_to_head(groups.ulysses, x, "x").wait_one();
      at::Tensor back = launch_head_to_seq(groups.ulysses, heads, "x").wait_one();
      EXPECT_EQ(back.scalar_type(), dtype);
      EXPECT_TRUE(bits_equal(back, x)) << "dtype " << dtype;
    }
  }, kRunTimeout));
}

TEST_P(Collectives, PackedExchangeEqualsSeparateExchanges) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const std::vector<int64_t> widths{5, 5, 3};
    std::vector<at::Tensor> xs;
    for (size_t k = 0; k < widths.size(); ++k) xs.push_back(tagged(rank, kB, kS, kH, widths[k]) + 1e5 * k);
    std::vector<at::Tensor> packed = launch_seq_to_head_packed(groups.cp, xs, "qkv").wait();
    ASSERT_EQ(packed.size(), widths.size());
    for (size_t k = 0; k < widths.size(); ++k) {
      at::Tensor separate = launch_seq_to_head(groups.cp, xs[k], "x").wait_one();
      EXPECT_TRUE(at::equal(packed[k], separate)) << "tensor " << k;
      EXPECT_TRUE(at::equal(packed[k], expected_seq_to_head(iota(world), rank, kB, kS, kH, widths[k]) + 1e5 * k))
          << "tensor " << k;
    }
    // And back: packed head->seq equals separate head->seq and restores the inputs.
    std::vector<at::Tensor> restored = launch_head_to_seq_packed(groups.cp, packed, "o").wait();
    ASSERT_EQ(restored.size(), widths.size());
    for (size_t k = 0; k < widths.size(); ++k) {
      at::Tensor separate = launch_head_to_seq(groups.cp, packed[k], "o").wait_one();
      EXPECT_TRUE(at::equal(restored[k], separate)) << "tensor " << k;
      EXPECT_TRUE(at::equal(restored[k], xs[k])) << "tensor " << k;
    }
  }, kRunTimeout));
}

// --- all-gather, reduce-scatter, all-reduce --------------------------------------------------
TEST_P(Collectives, AllGatherSeqConcatenatesInGroupRankOrder) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world;
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    at::Tensor out = launch_all_gather_seq(groups.cp, x, "latent").wait_one();
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{kB, G * kS, kH, kD}));
    at::Tensor T = axis(G * kS, 1, 4);
    at::Tensor expected =
        tag(at::floor_divide(T, kS), axis(kB, 0, 4), at::remainder(T, kS), axis(kH, 2, 4), axis(kD, 3, 4)).to(at::kFloat);
    EXPECT_TRUE(at::equal(out, expected));
    // 3-D [B, S_l, C] (the latent's layout).
    at::Tensor x3 = tagged(rank, kB, kS, 1, 7).squeeze(2);
    at::Tensor out3 = launch_all_gather_seq(groups.cp, x3, "latent").wait_one();
    ASSERT_EQ(out3.sizes(), (std::vector<int64_t>{kB, G * kS, 7}));
    EXPECT_TRUE(at::equal(out3, tag(at::floor_divide(T, kS), axis(kB, 0, 4), at::remainder(T, kS),
                                    at::zeros({1}, at::kDouble), axis(7, 3, 4))
                                    .to(at::kFloat)
                                    .squeeze(2)));
  }, kRunTimeout));
}

TEST_P(Collectives, ReduceScatterSeqSumsThisRanksBlockAndEqualsAllReduceThenSlice) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world;
    at::Tensor x = tagged(rank, kB, G * kS, kH, kD);  // [B, G*S_l, H, D]
    at::Tensor out = launch_reduce_scatter_seq(groups.cp, x, "dlatent").wait_one();
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{kB, kS, kH, kD}));
    // sum_r tag(r, b, rank*S_l + t, h, d) (exact in float32)
    double rank_sum = 0;
    for (int64_t r = 0; r < G; ++r) rank_sum += r;
    at::Tensor one = at::ones({1}, at::kDouble);
    at::Tensor expected = (tag(one * rank_sum, axis(kB, 0, 4) * G, (axis(kS, 1, 4) + double(rank * kS)) * G,
                               axis(kH, 2, 4) * G, axis(kD, 3, 4) * G))
                              .to(at::kFloat);
    EXPECT_TRUE(at::equal(out, expected));
    at::Tensor reduced = launch_all_reduce_sum(groups.cp, x, "sum").wait_one();
    EXPECT_TRUE(at::equal(out, reduced.narrow(1, rank * kS, kS)));
    // Batch 1 and a 3-D layout too.
    at::Tensor x1 = tagged(rank, 1, G * kS, 1, 6).squeeze(2);
    at::Tensor out1 = launch_reduce_scatter_seq(groups.cp, x1, "dlatent").wait_one();
    at::Tensor reduced1 = launch_all_reduce_sum(groups.cp, x1, "sum").wait_one();
    EXPECT_TRUE(at::equal(out1, reduced1.narrow(1, rank * kS, kS)));
  }, kRunTimeout));
}

TEST_P(Collectives, AllReduceSumIsTheSumOverRanksAndLeavesTheInputAlone) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    at::Tensor out = launch_all_reduce_sum(groups.world, x, "grad").wait_one();
    at::Tensor expected = at::zeros_like(x);
    for (int64_t r = 0; r < world; ++r) expected += tagged(r, kB, kS, kH, kD);
    EXPECT_TRUE(at::equal(out, expected));
    EXPECT_TRUE(at::equal(x, tagged(rank, kB, kS, kH, kD)));
    EXPECT_NE(out.data_ptr(), x.data_ptr());
    // Any shape, including a scalar-like 1-element tensor and float64.
    at::Tensor s = at::full({1}, static_cast<double>(rank + 1), at::kDouble);
    EXPECT_EQ(launch_all_reduce_sum(groups.world, s, "n").wait_one().item<double>(), world * (world + 1) / 2.0);
  }, kRunTimeout));
}

// --- bf16 ------------------------------------------------------------------------------------
TEST_P(Collectives, Bf16TravelsBitExactThroughSeqToHeadAndAllGather) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world, Hc = kH / G;
    std::vector<at::Tensor> inputs;
    for (int64_t r = 0; r < G; ++r) inputs.push_back(random_input(r, {kB, kS, kH, 4}, at::kBFloat16));
    at::Tensor heads = launch_seq_to_head(groups.cp, inputs[rank], "q").wait_one();
    std::vector<at::Tensor> blocks;
    for (int64_t r = 0; r < G; ++r) blocks.push_back(inputs[r].narrow(2, rank * Hc, Hc));
    EXPECT_EQ(heads.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(bits_equal(heads, at::cat(blocks, 1)));
    at::Tensor gathered = launch_all_gather_seq(groups.cp, inputs[rank], "latent").wait_one();
    EXPECT_EQ(gathered.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(bits_equal(gathered, at::cat(inputs, 1)));
  }, kRunTimeout));
}

TEST_P(Collectives, Bf16ReductionsAreWithinBf16RoundingOfTheFloat64Sum) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world;
    std::vector<at::Tensor> inputs;
    for (int64_t r = 0; r < G; ++r) inputs.push_back(random_input(r, {kB, G * kS, kH, 4}, at::kBFloat16));
    at::Tensor sum64 = at::zeros(inputs[0].sizes(), at::kDouble);
    for (const auto& x : inputs) sum64 += x.to(at::kDouble);
    auto check = [](const at::Tensor& got, const at::Tensor& want, const char* what) {
      EXPECT_EQ(got.scalar_type(), at::kBFloat16) << what;
      ASSERT_EQ(got.sizes(), want.sizes()) << what;
      // One rounding to bf16 (8 significant bits): |error| <= 2^-8 |sum|, plus float32 slack.
      at::Tensor error = (got.to(at::kDouble) - want).abs();
      at::Tensor bound = want.abs() * std::ldexp(1.0, -8) + 1e-6;
      EXPECT_TRUE(error.le(bound).all().item<bool>())
          << what << ": max error " << error.max().item<double>() << " vs sum magnitude "
          << want.abs().max().item<double>();
    };
    check(launch_reduce_scatter_seq(groups.cp, inputs[rank], "d").wait_one(), sum64.narrow(1, rank * kS, kS),
          "reduce_scatter");
    check(launch_all_reduce_sum(groups.cp, inputs[rank], "d").wait_one(), sum64, "all_reduce");
  }, kRunTimeout));
}

// --- non-contiguous inputs -------------------------------------------------------------------
TEST_P(Collectives, NonContiguousInputsGiveTheSameResults) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world;
    // A transposed view with the same values as the contiguous tensor.
    auto transposed_view = [](const at::Tensor& t) { return t.transpose(1, 2).contiguous().transpose(1, 2); };
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    at::Tensor xv = transposed_view(x);
    ASSERT_FALSE(xv.is_contiguous());
    ASSERT_TRUE(at::equal(x, xv));
    const CommGroup& cp = groups.cp;
    EXPECT_TRUE(at::equal(launch_seq_to_head(cp, xv, "a").wait_one(), expected_seq_to_head(iota(G), rank, kB, kS, kH, kD)));
    at::Tensor x5 = tagged(rank, kB, kS, kH, 5), x5v = transposed_view(x5);
    std::vector<at::Tensor> packed = launch_seq_to_head_packed(cp, {xv, x5v}, "a").wait();
    EXPECT_TRUE(at::equal(packed[0], launch_seq_to_head(cp, x, "a").wait_one()));
    EXPECT_TRUE(at::equal(packed[1], launch_seq_to_head(cp, x5, "a").wait_one()));
    at::Tensor y = tagged(rank, kB, G * kS, kH / G, kD), yv = transposed_view(y);
    ASSERT_FALSE(yv.is_contiguous());
    EXPECT_TRUE(at::equal(launch_head_to_seq(cp, yv, "b").wait_one(), launch_head_to_seq(cp, y, "b").wait_one()));
    EXPECT_TRUE(at::equal(launch_all_gather_seq(cp, xv, "c").wait_one(), launch_all_gather_seq(cp, x, "c").wait_one()));
    at::Tensor z = tagged(rank, kB, G * kS, kH, kD), zv = transposed_view(z);
    EXPECT_TRUE(
        at::equal(launch_reduce_scatter_seq(cp, zv, "d").wait_one(), launch_reduce_scatter_seq(cp, z, "d").wait_one()));
    EXPECT_TRUE(at::equal(launch_all_reduce_sum(cp, zv, "e").wait_one(), launch_all_reduce_sum(cp, z, "e").wait_one()));
    // bf16 views too.
    at::Tensor b16 = random_input(rank, {kB, kS, kH, kD}, at::kBFloat16), b16v = transposed_view(b16);
    EXPECT_TRUE(bits_equal(launch_seq_to_head(cp, b16v, "f").wait_one(), launch_seq_to_head(cp, b16, "f").wait_one()));
    EXPECT_TRUE(
        bits_equal(launch_all_gather_seq(cp, b16v, "f").wait_one(), launch_all_gather_seq(cp, b16, "f").wait_one()));
  }, kRunTimeout));
}

// --- the hybrid A x U grid -------------------------------------------------------------------
TEST(CollectivesHybrid, UlyssesGroupsAreConsecutiveAndAllGatherGroupsAreStrided) {
  EXPECT_TRUE(run_ranks(4, [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, 4, 1, 2}, fast_options());
    EXPECT_EQ(groups.shape.ulysses, 2);
    EXPECT_EQ(groups.ulysses.size(), 2);
    EXPECT_EQ(groups.ulysses.rank(), rank % 2);
    EXPECT_EQ(groups.all_gather.size(), 2);
    EXPECT_EQ(groups.all_gather.rank(), rank / 2);
    // Rank-tagged all-gathers reveal the members in group-rank order.
    auto members = [&](const CommGroup& group) {
      at::Tensor mine = at::full({1, 1}, static_cast<double>(rank), at::kFloat);
      at::Tensor all = launch_all_gather_seq(group, mine, "who").wait_one();
      std::vector<int64_t> out;
      for (int64_t i = 0; i < all.size(1); ++i) out.push_back(static_cast<int64_t>(all[0][i].item<float>()));
      return out;
    };
    const int64_t base = (rank / 2) * 2;
    EXPECT_EQ(members(groups.ulysses), (std::vector<int64_t>{base, base + 1}));
    EXPECT_EQ(members(groups.all_gather), (std::vector<int64_t>{rank % 2, rank % 2 + 2}));
    EXPECT_EQ(members(groups.cp), (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(members(groups.world), (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(all_gather_u64(groups.ulysses, 100 + rank), (std::vector<uint64_t>{static_cast<uint64_t>(100 + base), static_cast<uint64_t>(101 + base)}));
    // seq->head inside a Ulysses pair: sources are the pair's world ranks.
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    at::Tensor heads = launch_seq_to_head(groups.ulysses, x, "q").wait_one();
    EXPECT_TRUE(at::equal(heads, expected_seq_to_head({base, base + 1}, rank % 2, kB, kS, kH, kD)));
    EXPECT_TRUE(at::equal(launch_head_to_seq(groups.ulysses, heads, "o").wait_one(), x));
    // ... then an all-gather across the pairs: all four ranks' tokens of this head block.
    at::Tensor full = launch_all_gather_seq(groups.all_gather, heads, "kv").wait_one();
    // Explicit: tokens of world rank w at [w*S_l, (w+1)*S_l), heads [u*H/2, (u+1)*H/2).
    at::Tensor T = axis(4 * kS, 1, 4);
    at::Tensor expected = tag(at::floor_divide(T, kS), axis(kB, 0, 4), at::remainder(T, kS),
                              axis(kH / 2, 2, 4) + double((rank % 2) * kH / 2), axis(kD, 3, 4))
                              .to(at::kFloat);
    EXPECT_TRUE(at::equal(full, expected));
  }, kRunTimeout));
}

// --- byte counters ---------------------------------------------------------------------------
TEST_P(Collectives, ByteCountersFollowTheFormulas) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const int64_t G = world;
    CommCounters& counters = *groups.instruments.counters;
    auto only = [&](CollectiveKind kind, int64_t bytes, const std::string& label, int64_t handle_bytes,
                    const std::string& what) {
      for (CollectiveKind k : {CollectiveKind::all_to_all, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                               CollectiveKind::all_reduce}) {
        EXPECT_EQ(counters.by_kind(k).bytes, k == kind ? bytes : 0) << what << " " << collective_kind_name(k);
        EXPECT_EQ(counters.by_kind(k).calls, k == kind ? 1 : 0) << what << " " << collective_kind_name(k);
      }
      EXPECT_EQ(counters.total_bytes(), bytes) << what;
      ASSERT_EQ(counters.by_label().count(label), 1u) << what;
      EXPECT_EQ(counters.by_label().at(label).bytes, bytes) << what;
      EXPECT_EQ(handle_bytes, bytes) << what;
      counters.reset();
    };
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
      const std::string name = std::string("dtype ") + c10::toString(dtype);
      const int64_t es = at::elementSize(dtype);
      const int64_t reduce_es = dtype == at::kBFloat16 ? 4 : es;  // reductions travel in float32
      counters.reset();
      at::Tensor x = random_input(rank, {kB, kS, kH, kD}, dtype);
      {
        AsyncHandle h = launch_seq_to_head(groups.cp, x, "s2h");
        const int64_t hb = h.bytes();
        at::Tensor heads = h.wait_one();
        only(CollectiveKind::all_to_all, x.numel() * es * (G - 1) / G, "s2h", hb, name + " seq_to_head");
        AsyncHandle back = launch_head_to_seq(groups.cp, heads, "h2s");
        const int64_t bb = back.bytes();
        back.wait();
        only(CollectiveKind::all_to_all, heads.numel() * es * (G - 1) / G, "h2s", bb, name + " head_to_seq");
      }
      {
        at::Tensor x5 = random_input(rank, {kB, kS, kH, 5}, dtype), x3 = random_input(rank, {kB, kS, kH, 3}, dtype);
        AsyncHandle h = launch_seq_to_head_packed(groups.cp, {x, x5, x3}, "packed");
        const int64_t hb = h.bytes();
        h.wait();
        only(CollectiveKind::all_to_all, (x.numel() + x5.numel() + x3.numel()) * es * (G - 1) / G, "packed", hb,
             name + " packed");
      }
      {
        AsyncHandle h = launch_all_gather_seq(groups.cp, x, "ag");
        const int64_t hb = h.bytes();
        h.wait();
        only(CollectiveKind::all_gather, x.numel() * es * (G - 1), "ag", hb, name + " all_gather");
      }
      at::Tensor z = random_input(rank, {kB, G * kS, kH, kD}, dtype);
      {
        AsyncHandle h = launch_reduce_scatter_seq(groups.cp, z, "rs");
        const int64_t hb = h.bytes();
        h.wait();
        only(CollectiveKind::reduce_scatter, z.numel() * reduce_es * (G - 1) / G, "rs", hb, name + " reduce_scatter");
      }
      {
        AsyncHandle h = launch_all_reduce_sum(groups.cp, z, "ar");
        const int64_t hb = h.bytes();
        h.wait();
        only(CollectiveKind::all_reduce, 2 * z.numel() * reduce_es * (G - 1) / G, "ar", hb, name + " all_reduce");
      }
    }
    // Counters accumulate over calls and labels.
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    launch_seq_to_head(groups.cp, x, "q").wait();
    launch_seq_to_head(groups.cp, x, "q").wait();
    launch_all_gather_seq(groups.cp, x, "kv").wait();
    const int64_t a2a = x.numel() * 4 * (G - 1) / G, ag = x.numel() * 4 * (G - 1);
    EXPECT_EQ(counters.by_kind(CollectiveKind::all_to_all).bytes, 2 * a2a);
    EXPECT_EQ(counters.by_kind(CollectiveKind::all_to_all).calls, 2);
    EXPECT_EQ(counters.by_label().at("q").bytes, 2 * a2a);
    EXPECT_EQ(counters.by_label().at("kv").bytes, ag);
    EXPECT_EQ(counters.total_bytes(), 2 * a2a + ag);
  }, kRunTimeout));
}

TEST_P(Collectives, GroupsOfSizeOneMoveAndCountNothing) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    ASSERT_EQ(groups.tp.size(), 1);
    ASSERT_EQ(groups.dp.size(), 1);
    ASSERT_EQ(groups.all_gather.size(), 1);
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    for (const CommGroup* g : {&groups.tp, &groups.dp, &groups.all_gather}) {
      AsyncHandle h = launch_seq_to_head(*g, x, "a");
      EXPECT_EQ(h.bytes(), 0);
      EXPECT_TRUE(at::equal(h.wait_one(), x));
      EXPECT_TRUE(at::equal(launch_head_to_seq(*g, x, "b").wait_one(), x));
      std::vector<at::Tensor> packed = launch_seq_to_head_packed(*g, {x, x}, "c").wait();
      ASSERT_EQ(packed.size(), 2u);
      EXPECT_TRUE(at::equal(packed[1], x));
      EXPECT_TRUE(at::equal(launch_all_gather_seq(*g, x, "d").wait_one(), x));
      EXPECT_TRUE(at::equal(launch_reduce_scatter_seq(*g, x, "e").wait_one(), x));
      EXPECT_TRUE(at::equal(launch_all_reduce_sum(*g, x, "f").wait_one(), x));
      EXPECT_EQ(all_gather_u64(*g, 42), (std::vector<uint64_t>{42}));
      EXPECT_EQ(all_reduce_max(*g, {1.5, -2.0}), (std::vector<double>{1.5, -2.0}));
      EXPECT_EQ(all_reduce_min(*g, {1.5, -2.0}), (std::vector<double>{1.5, -2.0}));
      barrier(*g);
    }
    EXPECT_EQ(groups.instruments.counters->total_bytes(), 0);
    for (CollectiveKind k : {CollectiveKind::all_to_all, CollectiveKind::all_gather, CollectiveKind::reduce_scatter,
                             CollectiveKind::all_reduce})
      EXPECT_EQ(groups.instruments.counters->by_kind(k).calls, 0) << collective_kind_name(k);
    EXPECT_TRUE(groups.instruments.counters->by_label().empty());
  }, kRunTimeout));
}

// comm.h: launch_all_reduce_sum "Returns a new tensor" -- also for a group of one.
TEST_P(Collectives, AllReduceOnAGroupOfOneReturnsANewTensor) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    at::Tensor out = launch_all_reduce_sum(groups.tp, x, "f").wait_one();
    out.add_(1);
    EXPECT_TRUE(at::equal(x, tagged(rank, kB, kS, kH, kD))) << "the result aliases the input";
  }, kRunTimeout));
}

TEST_P(Collectives, AllReduceMaxAndAllGatherU64AndBarrier) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    std::vector<double> maxima = all_reduce_max(groups.world, {double(rank), -double(rank), rank == 1 ? 7.5 : 0.0});
    EXPECT_EQ(maxima, (std::vector<double>{double(world - 1), 0.0, 7.5}));
    std::vector<double> minima = all_reduce_min(groups.world, {double(rank), -double(rank), rank == 1 ? -7.5 : 0.0});
    EXPECT_EQ(minima, (std::vector<double>{0.0, -double(world - 1), -7.5}));
    std::vector<uint64_t> expected;
    for (int r = 0; r < world; ++r) expected.push_back(0xF000000000000000ull + r);
    EXPECT_EQ(all_gather_u64(groups.world, 0xF000000000000000ull + rank), expected);
    barrier(groups.world);
    EXPECT_EQ(groups.instruments.counters->total_bytes(), 0);  // control-plane calls are not counted
  }, kRunTimeout));
}

// --- the handle ------------------------------------------------------------------------------
TEST_P(Collectives, AHandleIsWaitedExactlyOnce) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    for (const CommGroup* g : {&groups.cp, &groups.tp}) {  // size G and size 1
      AsyncHandle h = launch_seq_to_head(*g, x, "q");
      EXPECT_TRUE(h.valid());
      EXPECT_EQ(h.label(), "q");
      h.wait();
      EXPECT_FALSE(h.valid());
      try {
        h.wait();
        ADD_FAILURE() << "a second wait() did not throw";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("waited exactly once"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("label=q"), std::string::npos) << e.what();
      }
      EXPECT_THROW(h.wait_one(), Error);
    }
    AsyncHandle empty;
    EXPECT_FALSE(empty.valid());
    EXPECT_EQ(empty.bytes(), 0);
    EXPECT_EQ(empty.label(), "");
    EXPECT_THROW(empty.wait(), Error);
    EXPECT_THROW(empty.wait_one(), Error);
    // A moved-from handle is empty; the moved-to one owns the collective.
    AsyncHandle a = launch_all_gather_seq(groups.cp, x, "kv");
    AsyncHandle b = std::move(a);
    EXPECT_TRUE(b.valid());
    EXPECT_EQ(b.wait_one().size(1), world * kS);
    // A launched handle that is never waited is finished by its destructor (no hang, no crash).
    { AsyncHandle dropped = launch_all_reduce_sum(groups.cp, x, "dropped"); }
    EXPECT_TRUE(at::equal(launch_all_reduce_sum(groups.cp, x, "after").wait_one().narrow(0, 0, 1),
                          [&] {
                            at::Tensor s = at::zeros_like(x);
                            for (int r = 0; r < world; ++r) s += tagged(r, kB, kS, kH, kD);
                            return s;
                          }()
                              .narrow(0, 0, 1)));
  }, kRunTimeout));
}

// Several collectives in flight at once complete independently, in any wait order.
TEST_P(Collectives, SeveralHandlesInFlightWaitedInReverseOrder) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    AsyncHandle a = launch_seq_to_head(groups.cp, x, "a");
    AsyncHandle b = launch_all_gather_seq(groups.cp, x, "b");
    AsyncHandle c = launch_all_reduce_sum(groups.cp, x, "c");
    at::Tensor rc = c.wait_one(), rb = b.wait_one(), ra = a.wait_one();
    EXPECT_TRUE(at::equal(ra, expected_seq_to_head(iota(world), rank, kB, kS, kH, kD)));
    EXPECT_EQ(rb.size(1), world * kS);
    EXPECT_TRUE(at::equal(rb.narrow(1, rank * kS, kS), x));
  }, kRunTimeout));
}

// comm.h: "inputs are read at launch". On rank 0 the collective under test is queued behind two
// all-reduces that wait for a late rank 1 (the Gloo group has two worker threads, both blocked),
// and rank 0 overwrites the inputs before waiting: the results must still be built from the values
// at launch. Returns the results of `launch`.
template <class Launch, class Clobber>
std::vector<at::Tensor> launch_held_back(const ParallelGroups& groups, int rank, Launch launch, Clobber clobber) {
  at::Tensor one = at::ones({4});
  if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  AsyncHandle block1 = launch_all_reduce_sum(groups.cp, one, "block");
  AsyncHandle block2 = launch_all_reduce_sum(groups.cp, one, "block");
  AsyncHandle handle = launch();
  if (rank == 0) clobber();
  block1.wait();
  block2.wait();
  return handle.wait();
}

TEST(CollectivesInputs, InputsAreReadAtLaunch) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    const CommGroup& cp = groups.cp;
    auto original = [](int64_t r) { return tagged(r, kB, kS, kH, kD); };
    at::Tensor x = original(rank);
    at::Tensor heads = launch_held_back(groups, rank, [&] { return launch_seq_to_head(cp, x, "a"); },
                                        [&] { x.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(heads, expected_seq_to_head(iota(2), rank, kB, kS, kH, kD))) << "seq_to_head";
    x = original(rank);
    at::Tensor x5 = tagged(rank, kB, kS, kH, 5);
    std::vector<at::Tensor> packed = launch_held_back(
        groups, rank, [&] { return launch_seq_to_head_packed(cp, {x, x5}, "a"); }, [&] { x.fill_(-1); x5.fill_(-1); });
    EXPECT_TRUE(at::equal(packed[0], expected_seq_to_head(iota(2), rank, kB, kS, kH, kD))) << "packed";
    EXPECT_TRUE(at::equal(packed[1], expected_seq_to_head(iota(2), rank, kB, kS, kH, 5))) << "packed";
    at::Tensor y = heads.clone();
    at::Tensor back = launch_held_back(groups, rank, [&] { return launch_head_to_seq(cp, y, "b"); },
                                       [&] { y.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(back, original(rank))) << "head_to_seq";
    at::Tensor z = tagged(rank, kB, 2 * kS, kH, kD);
    at::Tensor reduced = launch_held_back(groups, rank, [&] { return launch_all_reduce_sum(cp, z, "c"); },
                                          [&] { z.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(reduced, tagged(0, kB, 2 * kS, kH, kD) + tagged(1, kB, 2 * kS, kH, kD))) << "all_reduce";
    z = tagged(rank, kB, 2 * kS, kH, kD);
    at::Tensor scattered = launch_held_back(groups, rank, [&] { return launch_reduce_scatter_seq(cp, z, "d"); },
                                            [&] { z.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(scattered, reduced.narrow(1, rank * kS, kS))) << "reduce_scatter, batch 2";
    at::Tensor v = original(rank).transpose(1, 2).contiguous().transpose(1, 2);  // non-contiguous
    at::Tensor gathered = launch_held_back(groups, rank, [&] { return launch_all_gather_seq(cp, v, "e"); },
                                           [&] { v.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(gathered, at::cat({original(0), original(1)}, 1))) << "all_gather, non-contiguous input";
  }, kRunTimeout));
}

TEST(CollectivesInputs, AllGatherOfAContiguousInputIsReadAtLaunch) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    at::Tensor x = tagged(rank, kB, kS, kH, kD);
    at::Tensor gathered = launch_held_back(groups, rank, [&] { return launch_all_gather_seq(groups.cp, x, "e"); },
                                           [&] { x.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(gathered, at::cat({tagged(0, kB, kS, kH, kD), tagged(1, kB, kS, kH, kD)}, 1)));
  }, kRunTimeout));
}

TEST(CollectivesInputs, ReduceScatterWithBatchOneIsReadAtLaunch) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, fast_options());
    at::Tensor z = tagged(rank, 1, 2 * kS, kH, kD);
    at::Tensor s = launch_held_back(groups, rank, [&] { return launch_reduce_scatter_seq(groups.cp, z, "d"); },
                                    [&] { z.fill_(-1); })[0];
    EXPECT_TRUE(at::equal(s, (tagged(0, 1, 2 * kS, kH, kD) + tagged(1, 1, 2 * kS, kH, kD)).narrow(1, rank * kS, kS)));
  }, kRunTimeout));
}

// --- the emulated link -----------------------------------------------------------------------
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST_P(Collectives, EmulatedLinkDelaysCompletionAndWaitSleeps) {
  EXPECT_TRUE(run_ranks(world(), [](int rank, int world, const std::string& store) {
    GroupOptions options = fast_options();
    options.link.latency_seconds = 0.05;
    options.link.bandwidth_bytes_per_second = 1e6;
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, options);
    const int64_t G = world;
    ASSERT_TRUE(groups.instruments.link->enabled());
    // ~100 KB sent: float32 [1, 100, 4, D] with numel*4*(G-1)/G close to 1e5.
    const int64_t D = G == 2 ? 125 : 84;
    at::Tensor x = at::ones({1, 100, 4, D});
    const int64_t sent = x.numel() * 4 * (G - 1) / G;
    ASSERT_GE(sent, 90000);
    ASSERT_LE(sent, 160000);
    const double modelled = 0.05 + sent / 1e6;
    EXPECT_NEAR(groups.instruments.link->transfer_seconds(sent), modelled, 1e-12);
    barrier(groups.world);
    const auto start = Clock::now();
    AsyncHandle h = launch_seq_to_head(groups.cp, x, "q");
    EXPECT_EQ(h.bytes(), sent);
    const auto wait_start = Clock::now();
    const double thread_cpu0 = thread_cpu_seconds();
    const std::clock_t process_cpu0 = std::clock();
    at::Tensor out = h.wait_one();
    const std::clock_t process_cpu1 = std::clock();
    const double thread_cpu1 = thread_cpu_seconds();
    const auto end = Clock::now();
    const double total = std::chrono::duration<double>(end - start).count();
    const double waited = std::chrono::duration<double>(end - wait_start).count();
    const double process_cpu = double(process_cpu1 - process_cpu0) / CLOCKS_PER_SEC;
    EXPECT_GE(total, modelled - 1e-3) << "launch -> end of wait";
    EXPECT_LT(total, modelled + 2.0);
    EXPECT_EQ(out.size(1), G * 100);
    // The wait sleeps: CPU time used while waiting is far below the wall time.
    EXPECT_GT(waited, 0.1);
    EXPECT_LT(thread_cpu1 - thread_cpu0, 0.2 * waited) << "waiting thread spun";
    // The whole process includes Gloo's receiving threads, whose CPU is theirs, not the wait's
    // (measured 0.08 s in a 0.15 s wait on a loaded 2-core CI machine): bounded by one core, so a
    // spin on any thread still fails.
    EXPECT_LT(process_cpu, 1.0 * waited) << "process CPU during the wait";
    // Every kind is delayed, including all-gathers (bytes = numel * 4 * (G-1)).
    at::Tensor small = at::ones({1, 10, 4, 25});
    const int64_t gathered = small.numel() * 4 * (G - 1);
    const auto s2 = Clock::now();
    launch_all_gather_seq(groups.cp, small, "kv").wait();
    EXPECT_GE(std::chrono::duration<double>(Clock::now() - s2).count(), 0.05 + gathered / 1e6 - 1e-3);
  }, kRunTimeout));
}

// comm.h: CommTotals::wire_seconds is "launch -> completion, summed (emulated link: modelled time)".
TEST(CollectivesLink, WireSecondsAreRecorded) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options = fast_options();
    options.link.latency_seconds = 0.05;
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, options);
    launch_seq_to_head(groups.cp, tagged(rank, kB, kS, kH, kD), "q").wait();
    EXPECT_GE(groups.instruments.counters->by_kind(CollectiveKind::all_to_all).wire_seconds, 0.05);
    EXPECT_GE(groups.instruments.counters->by_label().at("q").wire_seconds, 0.05);
  }, kRunTimeout));
}

// One link per process: transfers queue behind the ones launched before them.
TEST(CollectivesLink, BookingQueuesTransfersBehindEachOther) {
  LinkModel link;
  link.bandwidth_bytes_per_second = 1e6;  // 1 byte per microsecond
  link.latency_seconds = 1e-3;
  const auto t0 = Clock::now();
  const auto us = [&](Clock::time_point t) { return std::chrono::duration<double, std::micro>(t - t0).count(); };
  auto [s1, d1] = link.book(t0, 2000);
  EXPECT_NEAR(us(s1), 0.0, 1e-3);
  EXPECT_NEAR(us(d1), 3000.0, 1e-3);
  // Launched while the first is on the link: starts when it is done.
  auto [s2, d2] = link.book(t0 + std::chrono::microseconds(500), 1000);
  EXPECT_NEAR(us(s2), 3000.0, 1e-3);
  EXPECT_NEAR(us(d2), 5000.0, 1e-3);
  // Launched after the link went idle: starts at its launch.
  auto [s3, d3] = link.book(t0 + std::chrono::microseconds(9000), 0);
  EXPECT_NEAR(us(s3), 9000.0, 1e-3);
  EXPECT_NEAR(us(d3), 10000.0, 1e-3);
}

TEST(CollectivesLink, ConcurrentTransfersShareTheLink) {
  EXPECT_TRUE(run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options = fast_options();
    options.link.bandwidth_bytes_per_second = 1e6;
    auto groups = make_groups(rank, world, store, MeshShape{1, world, 1}, options);
    at::Tensor x = at::ones({1, 100, 4, 125});  // 100 KB sent by each rank: 0.1 s on this link
    const double one = groups.instruments.link->transfer_seconds(x.numel() * 4 / 2);
    barrier(groups.world);
    const auto start = Clock::now();
    AsyncHandle a = launch_seq_to_head(groups.cp, x, "k");
    AsyncHandle b = launch_seq_to_head(groups.cp, x, "v");
    b.wait();
    EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 2 * one - 1e-3)
        << "the second transfer waits for the first";
    a.wait();
  }, kRunTimeout));
}

INSTANTIATE_TEST_SUITE_P(World, Collectives, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "world" + std::to_string(info.param); });

// --- the harness itself ----------------------------------------------------------------------
TEST(Harness, AllRanksPassingIsTrue) {
  EXPECT_TRUE(run_ranks(3, [](int rank, int world, const std::string& store) {
    EXPECT_EQ(world, 3);
    EXPECT_GE(rank, 0);
    EXPECT_LT(rank, 3);
    EXPECT_EQ(store.rfind("/tmp/", 0), 0u);
    EXPECT_EQ(at::get_num_threads(), 1);
  }));
}

TEST(Harness, ARankThatThrowsOrFailsAnExpectationIsFalse) {
  std::fprintf(stderr, "(the rank failures reported below are expected)\n");
  EXPECT_FALSE(run_ranks(2, [](int rank, int, const std::string&) {
    if (rank == 1) throw std::runtime_error("deliberate failure");
  }));
  EXPECT_FALSE(run_ranks(2, [](int rank, int, const std::string&) {
    EXPECT_EQ(rank, 0) << "(deliberate failure in a child)";
  }));
}

TEST(Harness, AHangingRankIsKilledAtTheTimeout) {
  const auto start = Clock::now();
  EXPECT_FALSE(run_ranks(2, [](int rank, int, const std::string&) {
    if (rank == 0) std::this_thread::sleep_for(std::chrono::seconds(60));
  }, std::chrono::seconds(1)));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0);
}

}  // namespace
}  // namespace mlacp
