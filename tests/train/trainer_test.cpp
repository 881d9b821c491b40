// The trainer against the single-process run (docs/DESIGN.md §7, §9): float64 losses and final parameters
// of CP runs (every strategy, hybrid, TP and DP layouts, overlap on) equal the single-process
// run within 1e-9; float32 loss curves within 1e-4; bf16 autocast trains and stays within the
// documented bound of float32; resuming from a checkpoint continues the same curve; bad input
// is a clear mlacp::Error before any collective.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/memory_probe.h"
#include "mlacp/errors.h"
#include "train_support.h"

namespace mlacp::train {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using test::RunResult;

constexpr int64_t kParitySteps = 20;
constexpr double kFloat64Parity = 1e-9;  // relative, losses and final parameters

// ---- float64 parity ---------------------------------------------------------------------------

struct ParityCase {
  std::string name;
  MeshShape mesh;
  CpStrategy strategy;
  CpPartition partition;
  bool kv_recompute = false;
};

std::ostream& operator<<(std::ostream& out, const ParityCase& c) { return out << c.name; }

class TrainParity : public ::testing::TestWithParam<ParityCase> {
 protected:
  // The single-process float64 run every case is compared with (computed once per process).
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>("parity");
    ASSERT_TRUE(test::run_training(test::small_config(at::kDouble, kParitySteps), reference_path()));
  }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::string reference_path() { return dir_->file("reference.pt"); }

 private:
  static std::unique_ptr<test::TempDir> dir_;
};
std::unique_ptr<test::TempDir> TrainParity::dir_;

TEST_P(TrainParity, LossesAndFinalParametersEqualTheSingleProcessRun) {
  const ParityCase& pc = GetParam();
  TrainConfig config = test::small_config(at::kDouble, kParitySteps, pc.mesh);
  config.strategy = pc.strategy;
  config.partition = pc.partition;
  config.overlap = true;  // the overlap schedules must give identical results
  config.kv_recompute = pc.kv_recompute;
  const std::string reference = reference_path();
  const int world = static_cast<int>(pc.mesh.dp * pc.mesh.cp * pc.mesh.tp);
  EXPECT_TRUE(mlacp::test::run_ranks(world, [&](int rank, int world_size, const std::string& store) {
    ParallelGroups groups = mlacp::test::make_groups(rank, world_size, store, config.mesh);
    Trainer trainer(config, groups);
    const RunResult mine = test::train_to_end(trainer);
    const RunResult ref = test::load_result(reference);
    ASSERT_EQ(mine.losses.size(), static_cast<size_t>(kParitySteps));
    EXPECT_LE(test::max_relative_loss_error(mine.losses, ref.losses), kFloat64Parity)
        << "rank " << rank << ": first loss " << mine.losses.front() << " vs " << ref.losses.front();
    EXPECT_LT(mine.losses.back(), mine.losses.front() - 1.0) << "the model learns";
    ASSERT_EQ(mine.parameters.size(), ref.parameters.size());
    double worst_parameter = 0.0;
    for (size_t i = 0; i < mine.parameters.size(); ++i) {
      const at::Tensor expected =
          test::tp_slice(mine.names[i], ref.parameters[i], config.model, groups.tp_rank, config.mesh.tp);
      const double error = test::relative_error(mine.parameters[i], expected);
      EXPECT_LE(error, kFloat64Parity) << "rank " << rank << " parameter " << mine.names[i];
      worst_parameter = std::max(worst_parameter, error);
    }
    if (rank == 0)
      std::printf("[ parity   ] %s: losses %.2e, final parameters %.2e (max relative difference, rank 0)\n",
                  pc.name.c_str(), test::max_relative_loss_error(mine.losses, ref.losses), worst_parameter);
  }));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TrainParity,
    ::testing::Values(
        ParityCase{"cp4_expanded_contiguous", {1, 4, 1, 0}, CpStrategy::expanded_ulysses, CpPartition::contiguous},
        ParityCase{"cp4_latent_head_tail", {1, 4, 1, 0}, CpStrategy::latent_kv_head, CpPartition::head_tail},
        ParityCase{"cp4_hybrid_u2_latent", {1, 4, 1, 2}, CpStrategy::latent_kv_head, CpPartition::head_tail},
        ParityCase{"cp4_hybrid_u2_latent_kv_recompute", {1, 4, 1, 2}, CpStrategy::latent_kv_head,
                   CpPartition::head_tail, true},
        ParityCase{"cp4_hybrid_u2_expanded", {1, 4, 1, 2}, CpStrategy::expanded_ulysses, CpPartition::contiguous},
        ParityCase{"cp2_tp2_latent", {1, 2, 2, 0}, CpStrategy::latent_kv_head, CpPartition::head_tail},
        ParityCase{"dp2_cp2_expanded", {2, 2, 1, 0}, CpStrategy::expanded_ulysses, CpPartition::head_tail}),
    [](const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

// ---- activation recomputation -------------------------------------------------------------

// train --recompute: each decoder layer's backward runs the layer again. The losses and the
// parameters after every step equal the plain run's to the bit (CP with the overlap schedules,
// float32 and bf16 autocast, one process), and the step's peak tensor bytes are lower.
struct RecomputeCase {
  std::string name;
  MeshShape mesh;
  CpStrategy strategy;
  at::ScalarType dtype;
};

std::ostream& operator<<(std::ostream& out, const RecomputeCase& c) { return out << c.name; }

class TrainRecompute : public ::testing::TestWithParam<RecomputeCase> {};

TEST_P(TrainRecompute, EqualsThePlainRunToTheBitAndPeaksLower) {
  const RecomputeCase& rc = GetParam();
  TrainConfig config = test::small_config(rc.dtype, 3, rc.mesh);
  config.model.num_layers = 4;
  config.seq_len = 256;
  config.strategy = rc.strategy;
  config.overlap = true;
  const int world = static_cast<int>(rc.mesh.dp * rc.mesh.cp * rc.mesh.tp);
  EXPECT_TRUE(mlacp::test::run_ranks(world, [&](int rank, int world_size, const std::string& store) {
    ParallelGroups groups = mlacp::test::make_groups(rank, world_size, store, config.mesh);
    RunResult runs[2];
    int64_t peaks[2] = {0, 0};
    for (int recompute = 0; recompute < 2; ++recompute) {
      TrainConfig c = config;
      c.recompute = recompute == 1;
      Trainer trainer(c, groups);
      MemoryScope scope;  // the steps: forward, backward, reduction, optimizer (its state included)
      runs[recompute] = test::train_to_end(trainer);
      peaks[recompute] = scope.peak_extra_bytes();
    }
    EXPECT_EQ(runs[1].losses, runs[0].losses) << "rank " << rank;
    ASSERT_EQ(runs[1].parameters.size(), runs[0].parameters.size());
    for (size_t i = 0; i < runs[0].parameters.size(); ++i)
      EXPECT_TRUE(at::equal(runs[1].parameters[i], runs[0].parameters[i])) << "rank " << rank << " " << runs[0].names[i];
    if (rank == 0)
      std::printf("[ recompute] %s: peak over the steps %.2f MiB plain, %.2f MiB recomputed (%.2fx)\n", rc.name.c_str(),
                  peaks[0] / 1048576.0, peaks[1] / 1048576.0, static_cast<double>(peaks[1]) / peaks[0]);
    EXPECT_LT(peaks[1], peaks[0]) << "rank " << rank;
  }));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TrainRecompute,
    ::testing::Values(RecomputeCase{"single_float32", {1, 1, 1, 0}, CpStrategy::latent_kv_head, at::kFloat},
                      RecomputeCase{"cp2_latent_float32", {1, 2, 1, 0}, CpStrategy::latent_kv_head, at::kFloat},
                      RecomputeCase{"cp2_expanded_bf16", {1, 2, 1, 0}, CpStrategy::expanded_ulysses, at::kBFloat16},
                      RecomputeCase{"cp2_tp2_latent_float64", {1, 2, 2, 0}, CpStrategy::latent_kv_head, at::kDouble}),
    [](const ::testing::TestParamInfo<RecomputeCase>& info) { return info.param.name; });

// ---- float32 and bf16 -----------------------------------------------------------------------

TEST(TrainFloat32, LossCurveFollowsTheSingleProcessRun) {
  test::TempDir dir("float32");
  constexpr int64_t steps = 50;
  ASSERT_TRUE(test::run_training(test::small_config(at::kFloat, steps), dir.file("single.pt")));
  TrainConfig cp = test::small_config(at::kFloat, steps, {1, 4, 1, 0});
  cp.strategy = CpStrategy::latent_kv_head;
  cp.partition = CpPartition::head_tail;
  ASSERT_TRUE(test::run_training(cp, dir.file("cp.pt")));
  const RunResult single = test::load_result(dir.file("single.pt")), parallel = test::load_result(dir.file("cp.pt"));
  ASSERT_EQ(parallel.losses.size(), static_cast<size_t>(steps));
  const double worst = test::max_relative_loss_error(parallel.losses, single.losses);
  std::printf("[ float32  ] cp=4 vs single over %lld steps: max relative loss difference %.2e\n",
              static_cast<long long>(steps), worst);
  EXPECT_LE(worst, kLossAgreementFloat32);
  EXPECT_LT(parallel.losses.back(), parallel.losses.front() - 1.5);
}

TEST(TrainBf16, AutocastTrainsWithinTheDocumentedBoundOfFloat32) {
  test::TempDir dir("bf16");
  constexpr int64_t steps = 50;
  ASSERT_TRUE(test::run_training(test::small_config(at::kFloat, steps), dir.file("float32.pt")));
  TrainConfig bf16 = test::small_config(at::kBFloat16, steps, {1, 2, 1, 0});
  bf16.strategy = CpStrategy::expanded_ulysses;
  bf16.partition = CpPartition::contiguous;
  ASSERT_TRUE(test::run_training(bf16, dir.file("bf16.pt")));
  const RunResult f32 = test::load_result(dir.file("float32.pt")), b16 = test::load_result(dir.file("bf16.pt"));
  ASSERT_EQ(b16.losses.size(), static_cast<size_t>(steps));
  const double worst = test::max_relative_loss_error(b16.losses, f32.losses);
  std::printf("[ bf16     ] cp=2 bf16 vs single float32 over %lld steps: max relative loss difference %.2e\n",
              static_cast<long long>(steps), worst);
  EXPECT_LE(worst, kLossAgreementBf16);
  EXPECT_GT(worst, 0.0) << "bf16 autocast must actually be on";
  EXPECT_LT(b16.losses.back(), b16.losses.front() - 1.5) << "bf16 training makes progress";
  for (double loss : b16.losses) EXPECT_TRUE(std::isfinite(loss));
}

// ---- checkpoints ------------------------------------------------------------------------------

TEST(TrainCheckpoint, ResumedRunContinuesTheSameLossCurve) {
  test::TempDir dir("resume");
  constexpr int64_t steps = 12, stop = 6;
  TrainConfig config = test::small_config(at::kDouble, steps, {1, 2, 1, 0});
  ASSERT_TRUE(test::run_training(config, dir.file("uninterrupted.pt")));

  TrainConfig first = config;
  first.steps = stop;
  first.checkpoint_dir = dir.file("ckpt");
  ASSERT_TRUE(test::run_training(first, dir.file("first.pt")));
  const CheckpointMeta meta = read_checkpoint_meta(first.checkpoint_dir);
  EXPECT_EQ(meta.step, stop);
  EXPECT_EQ(meta.data_position, stop * config.batch);

  std::filesystem::copy(first.checkpoint_dir, dir.file("ckpt-copy"),
                        std::filesystem::copy_options::recursive);  // for the layout change below

  TrainConfig second = config;
  second.checkpoint_dir = first.checkpoint_dir;
  second.resume = true;
  ASSERT_TRUE(test::run_training(second, dir.file("second.pt")));
  const RunResult whole = test::load_result(dir.file("uninterrupted.pt"));
  const RunResult a = test::load_result(dir.file("first.pt")), b = test::load_result(dir.file("second.pt"));
  std::vector<double> joined = a.losses;
  joined.insert(joined.end(), b.losses.begin(), b.losses.end());
  ASSERT_EQ(joined.size(), whole.losses.size());
  for (size_t i = 0; i < joined.size(); ++i) EXPECT_EQ(joined[i], whole.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < whole.parameters.size(); ++i)
    EXPECT_TRUE(at::equal(b.parameters[i], whole.parameters[i])) << "parameter " << i;

  // The checkpoint is layout-independent at equal tp: resume it on 1 rank without CP.
  TrainConfig single = second;
  single.mesh = {1, 1, 1, 0};
  single.checkpoint_dir = dir.file("ckpt-copy");
  ASSERT_TRUE(test::run_training(single, dir.file("single.pt")));
  const RunResult c = test::load_result(dir.file("single.pt"));
  const std::vector<double> tail(whole.losses.begin() + stop, whole.losses.end());
  EXPECT_LE(test::max_relative_loss_error(c.losses, tail), kFloat64Parity);
}

// Generations: each save is a new folder switched in by a rename; the two newest stay. What a kill
// leaves (a .partial folder of a cut save, a .pruning folder of a cut prune) is passed over, the
// run resumed from the newest complete generation continues the uninterrupted loss curve, and the
// next save removes the leftovers.
TEST(TrainCheckpoint, KeepsTwoGenerationsAndResumesFromTheNewestComplete) {
  namespace fs = std::filesystem;
  test::TempDir dir("generations");
  constexpr int64_t steps = 7, stop = 4;
  TrainConfig config = test::small_config(at::kDouble, steps);
  ASSERT_TRUE(test::run_training(config, dir.file("whole.pt")));
  TrainConfig first = config;
  first.steps = stop;
  first.checkpoint_dir = dir.file("ckpt");
  first.checkpoint_every = 1;
  ASSERT_TRUE(test::run_training(first, dir.file("first.pt")));
  const auto names_in = [](const fs::path& folder) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(folder)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  const fs::path ckpt = first.checkpoint_dir;
  EXPECT_EQ(names_in(ckpt), (std::vector<std::string>{"step-00000003", "step-00000004"}));

  // A killed save of step 5 (half a shard, no meta.json) and a killed prune of step 2 (meta.json gone).
  fs::create_directories(ckpt / ".step-00000005.partial");
  std::ofstream(ckpt / ".step-00000005.partial" / "tp0-of-1.pt") << "half a shard";
  fs::create_directories(ckpt / ".step-00000002.pruning");
  std::ofstream(ckpt / ".step-00000002.pruning" / "tp0-of-1.pt") << "what the prune left";
  const CheckpointMeta meta = read_checkpoint_meta(first.checkpoint_dir);
  EXPECT_EQ(meta.step, stop);
  EXPECT_EQ(fs::path(meta.folder).filename(), "step-00000004");

  TrainConfig second = config;
  second.checkpoint_dir = first.checkpoint_dir;
  second.checkpoint_every = 1;
  second.resume = true;
  ASSERT_TRUE(test::run_training(second, dir.file("second.pt")));
  const RunResult whole = test::load_result(dir.file("whole.pt")), b = test::load_result(dir.file("second.pt"));
  ASSERT_EQ(b.losses.size(), static_cast<size_t>(steps - stop));
  for (size_t i = 0; i < b.losses.size(); ++i) EXPECT_EQ(b.losses[i], whole.losses[stop + i]) << "step " << stop + i + 1;
  EXPECT_EQ(names_in(ckpt), (std::vector<std::string>{"step-00000006", "step-00000007"}));  // leftovers gone
}

// A run of two steps saved after each: a checkpoint folder with the generations of steps 1 and 2.
TrainConfig two_generations(test::TempDir& dir) {
  TrainConfig config = test::small_config(at::kDouble, 2);
  config.checkpoint_dir = dir.file("ckpt");
  config.checkpoint_every = 1;
  EXPECT_TRUE(test::run_training(config, dir.file("first.pt")));
  return config;
}

// A damaged newest generation (docs/DESIGN.md §8) is an error of kind fault naming the damaged file
// and the older generation to fall back to, never a silent fallback; accept_fallback takes that
// one and names what it passed over. Damage that only loading shows (a shard of another
// generation) names the shard and the way out, without LibTorch's stack trace.
TEST(TrainCheckpoint, ADamagedNewestGenerationIsNamedWithTheFallback) {
  namespace fs = std::filesystem;
  test::TempDir dir("damaged");
  const TrainConfig first = two_generations(dir);
  const fs::path ckpt = first.checkpoint_dir, older = ckpt / "step-00000001", newest = ckpt / "step-00000002";
  const auto expect_damaged = [&](const std::string& file, const std::string& problem, const std::string& fallback) {
    try {
      read_checkpoint_meta(first.checkpoint_dir);
      ADD_FAILURE() << "a damaged newest generation was taken: " << file;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::fault);
      EXPECT_THAT(e.what(), HasSubstr("the newest checkpoint generation is damaged"));
      EXPECT_THAT(e.what(), HasSubstr("file=" + file));
      EXPECT_THAT(e.what(), HasSubstr(problem));
      EXPECT_THAT(e.what(), HasSubstr(fallback));
    }
  };
  const fs::path shard = newest / "tp0-of-1.pt", saved = dir.file("shard.pt");
  fs::copy_file(shard, saved);
  fs::resize_file(shard, fs::file_size(shard) / 2);
  expect_damaged(shard.string(), "not a whole PyTorch archive", "--resume-fallback to resume from " + older.string());
  std::vector<std::string> passed_over;
  EXPECT_EQ(read_checkpoint_meta(first.checkpoint_dir, /*accept_fallback=*/true, &passed_over).step, 1);
  ASSERT_EQ(passed_over.size(), 1u);
  EXPECT_THAT(passed_over[0], HasSubstr(shard.string()));

  // Only loading reads a shard's step: step 1's shard in step 2's folder.
  fs::copy_file(older / "tp0-of-1.pt", shard, fs::copy_options::overwrite_existing);
  TrainConfig resume = first;
  resume.steps = 3;
  resume.resume = true;
  EXPECT_TRUE(mlacp::test::run_ranks(1, [&](int rank, int world, const std::string& store) {
    ParallelGroups groups = mlacp::test::make_groups(rank, world, store, resume.mesh);
    try {
      Trainer trainer(resume, groups);
      ADD_FAILURE() << "a shard of another generation was loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::fault);
      EXPECT_THAT(e.what(), HasSubstr("checkpoint shard and meta.json disagree"));
      EXPECT_THAT(e.what(), HasSubstr(shard.string()));
      EXPECT_THAT(e.what(), HasSubstr("to resume from " + older.string()));
      EXPECT_THAT(e.what(), Not(HasSubstr("frame #")));
    }
  }));
  fs::copy_file(saved, shard, fs::copy_options::overwrite_existing);

  std::ofstream(newest / "meta.json") << R"({"step": "two", "data_position": 2, "tp": 1})";
  expect_damaged((newest / "meta.json").string(), "\"step\" is missing or not an integer", "older_complete=" + older.string());
  fs::remove_all(older);
  expect_damaged((newest / "meta.json").string(), "\"step\" is missing", "no complete generation is left to fall back to");
}

// A damaged older generation does not matter; --resume-fallback goes with --resume only.
TEST(TrainCheckpoint, ADamagedOlderGenerationIsPassedOver) {
  namespace fs = std::filesystem;
  test::TempDir dir("damaged-older");
  const TrainConfig first = two_generations(dir);
  fs::remove(fs::path(first.checkpoint_dir) / "step-00000001" / "meta.json");  // as a prune before generations were renamed
  EXPECT_EQ(read_checkpoint_meta(first.checkpoint_dir).step, 2);
  try {
    TrainConfig stray = first;
    stray.resume_fallback = true;
    prepare_training(stray, 1);
    ADD_FAILURE() << "--resume-fallback without --resume was taken";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("it goes with --resume"));
  }
}

TEST(TrainCheckpoint, RejectsACheckpointOfAnotherRun) {
  test::TempDir dir("mismatch");
  TrainConfig first = test::small_config(at::kDouble, 2);
  first.checkpoint_dir = dir.file("ckpt");
  ASSERT_TRUE(test::run_training(first, dir.file("first.pt")));
  TrainConfig other = first;
  other.resume = true;
  other.steps = 4;
  other.seq_len = 32;
  try {
    prepare_training(other, 1);
    FAIL() << "expected mlacp::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("checkpoint does not match this run"));
    EXPECT_THAT(e.what(), HasSubstr("checkpoint.seq=64"));
    EXPECT_THAT(e.what(), HasSubstr("seq=32"));
  }
}

// ---- bad input ------------------------------------------------------------------------------

void expect_rejected(const TrainConfig& config, int64_t world_size, const std::vector<std::string>& parts) {
  try {
    prepare_training(config, world_size);
    ADD_FAILURE() << "expected mlacp::Error containing " << parts.front();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("mlacp: "));
    for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

TEST(TrainRejections, EachBadInputIsAClearError) {
  test::TempDir dir("rejections");
  TrainConfig c = test::small_config(at::kFloat, 5, {1, 4, 1, 0});

  TrainConfig missing = c;
  missing.corpus_path = dir.file("no-such-corpus");
  expect_rejected(missing, 4, {"the corpus path must exist", "no-such-corpus"});

  std::ofstream(dir.file("small.txt")) << "only a few bytes\n";
  TrainConfig small = c;
  small.corpus_path = dir.file("small.txt");
  expect_rejected(small, 4, {"too small for one sequence", "corpus_tokens=17", "seq_len=64"});

  TrainConfig indivisible = c;
  indivisible.partition = CpPartition::head_tail;
  indivisible.seq_len = 36;  // head_tail needs 2P = 8 | S
  expect_rejected(indivisible, 4, {"divisible by 2P (head_tail)", "seq_len=36", "cp=4"});

  TrainConfig contradictory = c;
  contradictory.mesh = {2, 2, 2, 0};
  expect_rejected(contradictory, 4, {"dp * cp * tp must equal the world size", "world_size=4"});

  TrainConfig batch = c;
  batch.mesh = {2, 2, 1, 0};
  batch.batch = 3;
  expect_rejected(batch, 4, {"divisible by dp", "batch=3", "dp=2"});

  TrainConfig heads = c;  // 4 heads cannot split over tp * U = 8
  heads.mesh = {1, 8, 1, 0};
  expect_rejected(heads, 8, {"heads"});

  TrainConfig resume = c;
  resume.resume = true;
  resume.checkpoint_dir = dir.file("empty");
  expect_rejected(resume, 4, {"--resume needs a checkpoint"});

  TrainConfig lr = c;
  lr.optimizer.lr = 0.0;
  expect_rejected(lr, 4, {"learning rate", "lr=0"});
}

TEST(TrainRejections, ComeBeforeAnyCollective) {
  // Rank 0 builds trainers from bad configs while rank 1 makes no call: a collective would block
  // until the timeout, so the errors must come at once.
  EXPECT_TRUE(mlacp::test::run_ranks(2, [](int rank, int world, const std::string& store) {
    GroupOptions options;
    options.timeout = std::chrono::seconds(30);
    ParallelGroups groups = mlacp::test::make_groups(rank, world, store, MeshShape{1, 2, 1, 0}, options);
    if (rank != 0) return;
    TrainConfig indivisible = test::small_config(at::kFloat, 5, {1, 2, 1, 0});
    indivisible.partition = CpPartition::head_tail;
    indivisible.seq_len = 66;
    TrainConfig contradictory = test::small_config(at::kFloat, 5, {1, 4, 1, 0});
    TrainConfig missing = test::small_config(at::kFloat, 5, {1, 2, 1, 0});
    missing.corpus_path = "/nonexistent/corpus";
    const std::pair<TrainConfig, std::string> cases[] = {
        {indivisible, "divisible by 2P"}, {contradictory, "world_size=2"}, {missing, "corpus path must exist"}};
    for (const auto& [config, part] : cases) {
      const auto start = std::chrono::steady_clock::now();
      try {
        Trainer trainer(config, groups);
        ADD_FAILURE() << "expected mlacp::Error containing " << part;
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), HasSubstr(part));
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    }
  }));
}

}  // namespace
}  // namespace mlacp::train
