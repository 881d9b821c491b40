// blockwise_attention against reference_attention (the oracle): every mask kind, odd sizes with
// small blocks, float64 / float32 / bf16, every code path this CPU runs; plus block skipping
// and the memory bound at S = 8192.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "core/compat.h"
#include "core/memory_probe.h"
#include "kernels/blockwise_attention.h"
#include "kernels/reference_attention.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

enum class MaskKind { none, random_per_batch, broadcast_band, dead_rows };

struct Case {
  std::string name;
  int64_t batch = 2, heads = 2, sq = 37, sk = 37, dqk = 12, dv = 7;
  bool causal = true;
  std::vector<int64_t> doc_ends;
  std::vector<int64_t> q_tokens, k_tokens;  // empty: 0..S-1
  MaskKind mask = MaskKind::none;
  int64_t block_q = 8, block_k = 5;
};

std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> r;
  for (int64_t i = begin; i < end; ++i) r.push_back(i);
  return r;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"noncausal_odd", 2, 2, 37, 37, 12, 7, false});
  c.push_back({"causal_odd", 2, 2, 37, 37, 12, 7, true});
  c.push_back({"causal_default_blocks", 1, 2, 150, 150, 12, 7, true, {}, {}, {}, MaskKind::none, 0, 0});
  c.push_back({"docs_cross_blocks_causal", 2, 2, 37, 37, 12, 7, true, {3, 11, 12, 26, 37}});
  c.push_back({"docs_noncausal", 1, 3, 37, 37, 9, 16, false, {7, 20, 37}});
  c.push_back({"mask_random_per_batch", 2, 2, 29, 31, 12, 7, true, {}, {}, range(0, 31), MaskKind::random_per_batch});
  c.back().q_tokens = range(2, 31);
  c.push_back({"mask_band_broadcast_noncausal", 2, 2, 37, 37, 12, 7, false, {}, {}, {}, MaskKind::broadcast_band});
  c.push_back({"dead_rows", 2, 2, 37, 37, 12, 7, true, {}, {}, {}, MaskKind::dead_rows});
  // head_tail layout: rank 0 of 2 holds chunks 0 and 3 of a 48-token sequence.
  Case ht{"head_tail_queries_docs", 2, 2, 24, 48, 12, 7, true, {20, 48}};
  ht.q_tokens = range(0, 12);
  for (int64_t t : range(36, 48)) ht.q_tokens.push_back(t);
  c.push_back(ht);
  // Keys 10..29 only: query rows 0..9 see no key at all.
  Case ks{"key_subset_causal", 2, 2, 30, 20, 12, 7, true};
  ks.k_tokens = range(10, 30);
  c.push_back(ks);
  // Keys in reverse order, queries a strided subset.
  Case rev{"reversed_keys_strided_queries", 1, 2, 13, 40, 12, 7, true, {17, 40}};
  for (int64_t t = 39; t >= 0; --t) rev.k_tokens.push_back(t);
  for (int64_t t = 1; t < 40; t += 3) rev.q_tokens.push_back(t);
  c.push_back(rev);
  c.push_back({"dqk_equals_dv_one_row_blocks", 1, 1, 9, 11, 5, 5, false, {}, {}, {}, MaskKind::none, 1, 3});
  return c;
}

AttentionStructure structure_of(const Case& c) {
  AttentionStructure st;
  st.causal = c.causal;
  st.query_token_index = c.q_tokens.empty() ? at::arange(c.sq, at::kLong) : at::tensor(c.q_tokens, at::kLong);
  st.key_token_index = c.k_tokens.empty() ? at::arange(c.sk, at::kLong) : at::tensor(c.k_tokens, at::kLong);
  if (!c.doc_ends.empty()) st.document_ends = at::tensor(c.doc_ends, at::kLong);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/7);
  switch (c.mask) {
    case MaskKind::none: break;
    case MaskKind::random_per_batch:
      st.mask = at::rand({c.batch, 1, c.sq, c.sk}, gen, at::kDouble) < 0.7;
      st.mask.select(2, 3).fill_(false);  // one row without keys
      break;
    case MaskKind::broadcast_band: {
      at::Tensor i = st.query_token_index.view({-1, 1}), j = st.key_token_index.view({1, -1});
      st.mask = ((i - j).abs() < 6).view({1, 1, c.sq, c.sk});
      break;
    }
    case MaskKind::dead_rows:
      st.mask = at::ones({1, 1, c.sq, c.sk}, at::kBool);
      for (int64_t r : {0L, 5L, 6L, c.sq - 1}) st.mask.select(2, r).fill_(false);
      break;
  }
  return st;
}

struct Inputs {
  at::Tensor q, k, v, dout;
};

Inputs make_inputs(const Case& c, uint64_t seed = 1) {
  at::manual_seed(seed);
  return {
      at::randn({c.batch, c.heads, c.sq, c.dqk}, at::kDouble), at::randn({c.batch, c.heads, c.sk, c.dqk}, at::kDouble),
      at::randn({c.batch, c.heads, c.sk, c.dv}, at::kDouble), at::randn({c.batch, c.heads, c.sq, c.dv}, at::kDouble)};
}

struct Outcome {
  at::Tensor out, dq, dk, dv;
};

template <class Fn>
Outcome run(const Inputs& in, at::ScalarType dtype, Fn attention) {
  auto leaf = [dtype](const at::Tensor& t) { return t.to(dtype, false, /*copy=*/true).requires_grad_(true); };
  at::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  at::Tensor out = attention(q, k, v);
  out.backward(in.dout.to(out.scalar_type()));
  return {out.detach().to(at::kDouble), q.grad().to(at::kDouble), k.grad().to(at::kDouble), v.grad().to(at::kDouble)};
}

Outcome reference_run(const Case& c, const Inputs& in, at::ScalarType dtype = at::kDouble) {
  const AttentionStructure st = structure_of(c);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(c.dqk));
  return run(in, dtype, [&](auto& q, auto& k, auto& v) { return reference_attention(q, k, v, scaling, st); });
}

Outcome blockwise_run(const Case& c, const Inputs& in, at::ScalarType dtype, BlockwisePath path,
                      BlockwiseStats* stats = nullptr) {
  const AttentionStructure st = structure_of(c);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(c.dqk));
  BlockwiseOptions opt;
  opt.block_q = c.block_q, opt.block_k = c.block_k, opt.path = path, opt.stats = stats;
  return run(in, dtype, [&](auto& q, auto& k, auto& v) { return blockwise_attention(q, k, v, scaling, st, opt); });
}

// Runs a test body on `threads` intra-op threads (the default here is 1), restoring the count.
class ThreadsGuard {
 public:
  explicit ThreadsGuard(int threads) : saved_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~ThreadsGuard() { at::set_num_threads(saved_); }

 private:
  int saved_;
};

double max_abs(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }
double rel_max(const at::Tensor& a, const at::Tensor& ref) {
  return max_abs(a, ref) / std::max(ref.abs().max().item<double>(), 1e-300);
}
double rel_norm(const at::Tensor& a, const at::Tensor& ref) {
  return (a - ref).norm().item<double>() / std::max(ref.norm().item<double>(), 1e-300);
}

std::vector<BlockwisePath> float32_paths() {
  std::vector<BlockwisePath> paths{BlockwisePath::float32_portable};
  for (BlockwisePath p : {BlockwisePath::float32_avx512, BlockwisePath::float32_avx2})
    if (path_supported(p)) paths.push_back(p);
  return paths;
}

// The bf16 paths this CPU runs, forced, after the kernel's own choice.
std::vector<BlockwisePath> bf16_paths() {
  std::vector<BlockwisePath> paths{BlockwisePath::automatic};
  for (BlockwisePath p : {BlockwisePath::bf16_avx512, BlockwisePath::bf16_via_f32_avx512, BlockwisePath::bf16_amx,
                          BlockwisePath::bf16_via_f32_avx2})
    if (path_supported(p)) paths.push_back(p);
  return paths;
}

TEST(BlockwiseAttention, Float64EqualsReferenceForEveryMaskKind) {
  for (int threads : {1, 3}) {
    ThreadsGuard guard(threads);
    for (const Case& c : cases()) {
      const Inputs in = make_inputs(c);
      const Outcome ref = reference_run(c, in);
      const Outcome got = blockwise_run(c, in, at::kDouble, BlockwisePath::automatic);
      const std::string what = c.name + " on " + std::to_string(threads) + " threads";
      EXPECT_LE(max_abs(got.out, ref.out), 1e-10) << what;
      EXPECT_LE(max_abs(got.dq, ref.dq), 1e-10) << what;
      EXPECT_LE(max_abs(got.dk, ref.dk), 1e-10) << what;
      EXPECT_LE(max_abs(got.dv, ref.dv), 1e-10) << what;
    }
  }
}

TEST(BlockwiseAttention, Float32EqualsReferenceOnEveryPath) {
  ThreadsGuard guard(2);
  for (BlockwisePath path : float32_paths()) {
    for (const Case& c : cases()) {
      const Inputs in = make_inputs(c);
      const Outcome ref = reference_run(c, in);
      const Outcome got = blockwise_run(c, in, at::kFloat, path);
      const std::string what = c.name + " on " + path_name(path);
      EXPECT_LE(rel_max(got.out, ref.out), 1e-5) << what;
      EXPECT_LE(rel_max(got.dq, ref.dq), 1e-5) << what;
      EXPECT_LE(rel_max(got.dk, ref.dk), 1e-5) << what;
      EXPECT_LE(rel_max(got.dv, ref.dv), 1e-5) << what;
    }
  }
}

// bf16: the blockwise kernel under bf16 autocast (and on bf16 tensors) may err at most twice as
// much as the reference does under the same autocast, both measured against float64.
void expect_bf16_within_twice_the_reference(Case c, int64_t dqk, int64_t dv, BlockwisePath path) {
  c.dqk = dqk, c.dv = dv;  // enough elements for stable error norms
  const Inputs in = make_inputs(c, 3);
  const Outcome truth = reference_run(c, in);
  Outcome ref_bf16, ours_autocast;
  {
    compat::AutocastGuard autocast(c10::DeviceType::CPU, true, at::kBFloat16);
    ref_bf16 = reference_run(c, in, at::kFloat);
    ours_autocast = blockwise_run(c, in, at::kFloat, path);
  }
  const Outcome ours_bf16 = blockwise_run(c, in, at::kBFloat16, path);
  const std::vector<std::pair<const char*, at::Tensor Outcome::*>> parts{
      {"out", &Outcome::out}, {"dq", &Outcome::dq}, {"dk", &Outcome::dk}, {"dv", &Outcome::dv}};
  const std::string what =
      c.name + " Dqk=" + std::to_string(dqk) + " Dv=" + std::to_string(dv) + " " + path_name(path) + " ";
  for (const auto& [name, member] : parts) {
    const double ref_err = rel_norm(ref_bf16.*member, truth.*member);
    EXPECT_LE(rel_norm(ours_autocast.*member, truth.*member), 2 * ref_err) << what << name << " autocast";
    EXPECT_LE(rel_norm(ours_bf16.*member, truth.*member), 2 * ref_err) << what << name << " bf16 inputs";
    EXPECT_LT(ref_err, 0.05) << what << name;  // the comparison means something
  }
}

TEST(BlockwiseAttention, Bf16WithinTwiceTheReferenceAutocastError) {
  ThreadsGuard guard(2);
  for (BlockwisePath path : bf16_paths())
    for (const Case& c : cases()) {
      expect_bf16_within_twice_the_reference(c, 48, 32, path);
      expect_bf16_within_twice_the_reference(c, 47, 33, path);  // odd widths: bf16 pairs need padding
    }
}

TEST(BlockwiseAttention, Bf16PathChoiceIsARunnablePathWithItsMeasurement) {
  const Bf16PathChoice c = bf16_path_choice();
  EXPECT_TRUE(path_supported(c.path)) << c.reason;
  EXPECT_NE(c.reason.find(path_name(c.path)), std::string::npos) << c.reason;
  const double others = std::max(c.dot_gflops, c.fma_gflops);
  if (c.path == BlockwisePath::bf16_amx) EXPECT_GE(c.amx_gflops, 1.25 * others) << c.reason;
  if (c.amx_gflops > 0 && c.path != BlockwisePath::bf16_amx) EXPECT_LT(c.amx_gflops, 1.25 * others) << c.reason;
  EXPECT_EQ(c.amx_gflops > 0, path_supported(BlockwisePath::bf16_amx)) << c.reason;
  if (c.path == BlockwisePath::bf16_avx512) EXPECT_GE(c.dot_gflops, 1.25 * c.fma_gflops) << c.reason;
  if (c.dot_gflops > 0 && c.path != BlockwisePath::bf16_avx512 && c.path != BlockwisePath::bf16_amx)
    EXPECT_LT(c.dot_gflops, 1.25 * c.fma_gflops) << c.reason;
  Case k{"choice", 1, 2, 20, 20, 8, 6, true};
  BlockwiseStats stats;
  blockwise_run(k, make_inputs(k), at::kBFloat16, BlockwisePath::automatic, &stats);
  EXPECT_EQ(stats.path, c.path);
}

// Under bf16 autocast, float32 inputs are rounded to bf16 before any product, on every bf16
// path: the result equals the same path on the bf16 tensors themselves.
TEST(BlockwiseAttention, Bf16AutocastRoundsFloat32InputsOnEveryBf16Path) {
  Case c{"autocast_rounding", 1, 2, 29, 29, 10, 7, true, {13, 29}};
  const Inputs in = make_inputs(c, 3);
  const AttentionStructure st = structure_of(c);
  for (BlockwisePath path : bf16_paths()) {
    BlockwiseOptions opt;
    opt.block_q = 8, opt.block_k = 5, opt.path = path;
    const at::Tensor q = in.q.to(at::kFloat), k = in.k.to(at::kFloat), v = in.v.to(at::kFloat);
    at::Tensor from_float;
    {
      compat::AutocastGuard autocast(c10::DeviceType::CPU, true, at::kBFloat16);
      from_float = blockwise_attention(q, k, v, 0.4, st, opt);
    }
    const at::Tensor from_bf16 =
        blockwise_attention(q.to(at::kBFloat16), k.to(at::kBFloat16), v.to(at::kBFloat16), 0.4, st, opt);
    EXPECT_EQ(max_abs(from_float.to(at::kBFloat16).to(at::kFloat), from_bf16.to(at::kFloat)), 0.0) << path_name(path);
    EXPECT_GT(max_abs(from_float, blockwise_attention(q, k, v, 0.4, st, BlockwiseOptions{})), 0.0)
        << path_name(path) << ": no rounding happened";
  }
}

TEST(BlockwiseAttention, Bf16InputsGiveBf16OutputsAndGradients) {
  Case c{"bf16_dtypes", 1, 2, 20, 20, 8, 6, true};
  const Inputs in = make_inputs(c);
  at::Tensor q = in.q.to(at::kBFloat16).requires_grad_(true), k = in.k.to(at::kBFloat16).requires_grad_(true);
  at::Tensor v = in.v.to(at::kBFloat16).requires_grad_(true);
  BlockwiseResult r = blockwise_attention_with_lse(q, k, v, 0.3, structure_of(c));
  EXPECT_EQ(r.out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(r.lse.scalar_type(), at::kFloat);
  r.out.sum().backward();
  EXPECT_EQ(q.grad().scalar_type(), at::kBFloat16);
  EXPECT_EQ(v.grad().scalar_type(), at::kBFloat16);
}

TEST(BlockwiseAttention, RowsWithoutKeysGiveExactZerosOnEveryPath) {
  Case c{"dead_rows", 2, 2, 37, 37, 12, 7, true, {}, {}, {}, MaskKind::dead_rows};
  const Inputs in = make_inputs(c);
  std::vector<std::pair<BlockwisePath, at::ScalarType>> runs{{BlockwisePath::float64_portable, at::kDouble}};
  for (BlockwisePath p : float32_paths()) runs.push_back({p, at::kFloat});
  for (BlockwisePath p : bf16_paths()) runs.push_back({p, at::kBFloat16});
  for (const auto& [path, dtype] : runs) {
    const Outcome got = blockwise_run(c, in, dtype, path);
    for (const at::Tensor* t : {&got.out, &got.dq, &got.dk, &got.dv})
      EXPECT_TRUE(t->isfinite().all().item<bool>()) << path_name(path);
    for (int64_t r : {0L, 5L, 6L, c.sq - 1}) {
      EXPECT_EQ(got.out.select(2, r).abs().max().item<double>(), 0.0) << path_name(path) << " row " << r;
      EXPECT_EQ(got.dq.select(2, r).abs().max().item<double>(), 0.0) << path_name(path) << " row " << r;
    }
    EXPECT_GT(got.dq.select(2, 1).abs().max().item<double>(), 0.0) << path_name(path);
  }
  const AttentionStructure st = structure_of(c);
  const BlockwiseResult r = blockwise_attention_forward(in.q, in.k, in.v, 0.5, st);
  EXPECT_TRUE(std::isinf(r.lse[0][0][5].item<double>()) && r.lse[0][0][5].item<double>() < 0);
}

// lse = log Σ exp(scaling · q·k) over allowed keys; a gradient on lse flows into q and k.
TEST(BlockwiseAttention, LogSumExpAndItsGradientMatchTheReferenceMath) {
  Case c{"lse", 2, 2, 37, 37, 12, 7, true, {9, 37}};
  const Inputs in = make_inputs(c);
  const AttentionStructure st = structure_of(c);
  const double scaling = 0.37;
  at::Tensor w = at::randn({c.batch, c.heads, c.sq}, at::kDouble);
  auto grads = [&](bool reference) {
    at::Tensor q = in.q.clone().requires_grad_(true), k = in.k.clone().requires_grad_(true);
    at::Tensor v = in.v.clone().requires_grad_(true);
    at::Tensor out, lse;
    if (reference) {
      at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) * scaling;
      scores = scores.masked_fill(allowed_pairs(st).logical_not(), -std::numeric_limits<double>::infinity());
      lse = at::logsumexp(scores, -1);
      out = reference_attention(q, k, v, scaling, st);
    } else {
      BlockwiseOptions opt;
      opt.block_q = 8, opt.block_k = 5;
      BlockwiseResult r = blockwise_attention_with_lse(q, k, v, scaling, st, opt);
      out = r.out, lse = r.lse;
    }
    ((out * in.dout).sum() + (lse * w).sum()).backward();
    return std::vector<at::Tensor>{lse.detach(), q.grad(), k.grad(), v.grad()};
  };
  const auto ref = grads(true), got = grads(false);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_LE(max_abs(got[i], ref[i]), 1e-10) << "tensor " << i;
}

TEST(BlockwiseAttention, ExplicitForwardBackwardEqualsAutograd) {
  Case c{"explicit", 2, 2, 37, 37, 12, 7, true, {11, 37}};
  const Inputs in = make_inputs(c);
  const AttentionStructure st = structure_of(c);
  BlockwiseOptions opt;
  opt.block_q = 8, opt.block_k = 5;
  const Outcome ag = blockwise_run(c, in, at::kDouble, BlockwisePath::automatic);
  const BlockwiseResult f = blockwise_attention_forward(in.q, in.k, in.v, 1.0 / std::sqrt(12.0), st, opt);
  const BlockwiseGrads g = blockwise_attention_backward(in.q, in.k, in.v, f.out, f.lse, in.dout, at::Tensor(),
                                                        1.0 / std::sqrt(12.0), st, opt);
  EXPECT_EQ(max_abs(f.out, ag.out), 0.0);
  EXPECT_EQ(max_abs(g.dq, ag.dq), 0.0);
  EXPECT_EQ(max_abs(g.dk, ag.dk), 0.0);
  EXPECT_EQ(max_abs(g.dv, ag.dv), 0.0);
}

// [B,S,H,D] storage viewed as [B,H,S,D] (what the MLA layer passes) is read through its strides;
// outputs and gradients keep that layout.
TEST(BlockwiseAttention, TransposedLayoutsGiveTheSameResultsAndKeepTheirLayout) {
  Case c{"bshd", 2, 3, 37, 37, 12, 7, true, {20, 37}};
  const Inputs in = make_inputs(c);
  const AttentionStructure st = structure_of(c);
  BlockwiseOptions opt;
  opt.block_q = 8, opt.block_k = 5;
  for (BlockwisePath path : float32_paths()) {
    opt.path = path;
    auto bshd = [](const at::Tensor& t) { return t.transpose(1, 2).contiguous().transpose(1, 2).to(at::kFloat); };
    at::Tensor q = bshd(in.q).requires_grad_(true), k = bshd(in.k).requires_grad_(true);
    at::Tensor v = bshd(in.v).requires_grad_(true);
    at::Tensor out = blockwise_attention(q, k, v, 0.3, st, opt);
    out.backward(in.dout.to(at::kFloat));
    EXPECT_TRUE(out.transpose(1, 2).is_contiguous()) << path_name(path);
    EXPECT_TRUE(q.grad().transpose(1, 2).is_contiguous()) << path_name(path);
    const Outcome ref =
        run(in, at::kFloat, [&](auto& a, auto& b, auto& d) { return blockwise_attention(a, b, d, 0.3, st, opt); });
    EXPECT_LE(max_abs(out.to(at::kDouble), ref.out), 1e-6) << path_name(path);
    EXPECT_LE(max_abs(q.grad().to(at::kDouble), ref.dq), 1e-6) << path_name(path);
    EXPECT_LE(max_abs(k.grad().to(at::kDouble), ref.dk), 1e-6) << path_name(path);
  }
}

TEST(BlockwiseAttention, InPlaceChangeOfASavedTensorIsAnErrorInBackward) {
  Case c{"inplace", 1, 2, 9, 9, 4, 4, true};
  const Inputs in = make_inputs(c);
  at::Tensor q = in.q.clone().requires_grad_(true);
  at::Tensor k = in.k.clone();
  at::Tensor out = blockwise_attention(q, k, in.v, 0.5, structure_of(c));
  k.mul_(2);
  try {
    out.sum().backward();
    ADD_FAILURE() << "backward must reject a key modified after the forward";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("modified in place"), std::string::npos) << e.what();
  }
}

// libgomp's pool does not survive fork(): a child forked after the parent used it must still be
// able to run the kernel (serially). Tensors stay small so ATen's own ops stay serial too.
TEST(BlockwiseAttention, ForkedChildRunsTheKernelAfterTheParentUsedThePool) {
  ThreadsGuard guard(2);
  Case c{"fork", 1, 2, 40, 40, 8, 8, true};
  const Inputs in = make_inputs(c);
  const Outcome parent = blockwise_run(c, in, at::kDouble, BlockwisePath::automatic);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(30);  // a hang ends the child with SIGALRM
    const Outcome child = blockwise_run(c, in, at::kDouble, BlockwisePath::automatic);
    _exit(max_abs(child.out, parent.out) == 0.0 && max_abs(child.dq, parent.dq) == 0.0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "child did not exit normally (signal " << WTERMSIG(status) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(BlockwiseAttention, CausalAndDocumentTilesAreSkipped) {
  const int64_t s = 64;
  Case full{"full", 1, 2, s, s, 8, 8, false, {}, {}, {}, MaskKind::none, 8, 8};
  Case causal = full;
  causal.causal = true;
  Case docs = causal;
  docs.doc_ends = {16, 32, 64};
  auto stats_of = [](const Case& c) {
    BlockwiseStats stats;
    blockwise_run(c, make_inputs(c), at::kFloat, BlockwisePath::automatic, &stats);
    return stats;
  };
  const BlockwiseStats f = stats_of(full), ca = stats_of(causal), d = stats_of(docs);
  EXPECT_EQ(f.blocks_total, 2 * 8 * 8);
  EXPECT_EQ(f.forward_blocks_computed, f.blocks_total);
  EXPECT_EQ(ca.forward_blocks_computed, 2 * 8 * 9 / 2);  // lower triangle incl. diagonal
  EXPECT_EQ(ca.forward_blocks_masked, 2 * 8);             // only diagonal tiles need a mask
  EXPECT_EQ(ca.backward_blocks_computed, ca.forward_blocks_computed);
  EXPECT_LT(static_cast<double>(ca.forward_blocks_computed) / f.forward_blocks_computed, 0.7);
  EXPECT_EQ(d.forward_blocks_computed, 2 * (3 + 3 + 10));  // triangles of 2, 2 and 4 blocks
  // head_tail rows: the head chunk sees one key block, the tail chunk all of them.
  Case ht = causal;
  ht.sq = 16, ht.q_tokens = range(0, 8);
  for (int64_t t : range(56, 64)) ht.q_tokens.push_back(t);
  EXPECT_EQ(stats_of(ht).forward_blocks_computed, 2 * (1 + 8));
}

TEST(BlockwiseAttention, RejectionsNameTheRule) {
  Case c{"reject", 1, 2, 8, 8, 4, 4, true};
  const Inputs in = make_inputs(c);
  const AttentionStructure st = structure_of(c);
  EXPECT_THROW(blockwise_attention(in.q, in.k.to(at::kFloat), in.v, 0.5, st), Error);
  AttentionStructure bad_mask = st;
  bad_mask.mask = at::ones({1, 2, 8, 8}, at::kBool);
  EXPECT_THROW(blockwise_attention(in.q, in.k, in.v, 0.5, bad_mask), Error);
  BlockwiseOptions opt;
  opt.path = BlockwisePath::float32_portable;
  try {
    blockwise_attention(in.q, in.k, in.v, 0.5, st, opt);
    ADD_FAILURE() << "float64 on a float32 path must be rejected";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not compute this dtype"), std::string::npos) << e.what();
  }
  EXPECT_THROW(blockwise_attention(in.q, in.k, in.v, -1.0, st), Error);
}

// The acceptance bound: forward + backward at S = 8192, 16 heads, Dqk 192, Dv 128, float32,
// causal keeps its temporaries (peak tensor bytes beyond the inputs, the output, lse and the
// three gradients; lse and D count as temporaries) under 5% of the S × S × 16 float32 scores (4 GiB). Measured: ~6 MiB.
TEST(BlockwiseAttention, TemporariesStayUnderFivePercentOfTheScoresAtS8192) {
  ThreadsGuard guard(2);
  const int64_t s = 8192, heads = 16, dqk = 192, dv = 128;
  at::manual_seed(0);
  at::Tensor q = at::randn({1, heads, s, dqk}).requires_grad_(true);
  at::Tensor k = at::randn({1, heads, s, dqk}).requires_grad_(true);
  at::Tensor v = at::randn({1, heads, s, dv}).requires_grad_(true);
  at::Tensor dout = at::randn({1, heads, s, dv});
  AttentionStructure st;
  st.causal = true;
  st.query_token_index = at::arange(s, at::kLong);
  st.key_token_index = at::arange(s, at::kLong);
  int64_t peak_extra = 0;
  at::Tensor out;
  {
    MemoryScope scope;
    out = blockwise_attention(q, k, v, 1.0 / std::sqrt(192.0), st);
    out.backward(dout);
    peak_extra = scope.peak_extra_bytes();
  }
  const int64_t results = out.nbytes() + q.grad().nbytes() + k.grad().nbytes() + v.grad().nbytes();
  const int64_t scores_bytes = heads * s * s * 4;
  const int64_t temporaries = peak_extra - results;
  EXPECT_LT(temporaries, scores_bytes / 20) << "peak extra " << peak_extra << " B, results " << results << " B";
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  RecordProperty("temporaries_bytes", std::to_string(temporaries));
}

TEST(MemoryProbe, CountsLiveAndPeakBytesAndFreesThroughTheOriginalDeleter) {
  MemoryScope scope;
  {
    at::Tensor a = at::empty({1 << 20}, at::kFloat);  // 4 MiB
    EXPECT_EQ(scope.current_extra_bytes(), 4 << 20);
    at::Tensor b = at::empty({1 << 18}, at::kFloat);  // 1 MiB
    EXPECT_EQ(a.storage().data_ptr().get_context(), a.data_ptr());
    EXPECT_EQ(scope.peak_extra_bytes(), 5 << 20);
  }
  EXPECT_EQ(scope.current_extra_bytes(), 0);
  EXPECT_EQ(scope.peak_extra_bytes(), 5 << 20);
  MemoryScope again;
  EXPECT_EQ(again.peak_extra_bytes(), 0);
}

}  // namespace
}  // namespace mlacp
