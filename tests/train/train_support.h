// Shared helpers of the training tests: the shipped corpus, small configs, and running a whole
// training on forked ranks with its results written to a file the parent (or later ranks) read.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include "support/multiprocess.h"
#include "train/trainer.h"

namespace mlacp::train::test {

// The corpus in the source tree (MLACP_SOURCE_DIR comes from tests/CMakeLists.txt; __FILE__ is
// not used because ccache's base_dir makes it relative to the build folder).
inline std::string shipped_corpus() {
#ifdef MLACP_SOURCE_DIR
  return (std::filesystem::path(MLACP_SOURCE_DIR) / "data" / "corpus").string();
#else
  return default_corpus_path();
#endif
}

// A fresh folder under /tmp, removed by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = std::filesystem::temp_directory_path() /
            ("mlacp-train-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path path_;
};

// The small training the tests share: "test" preset, S=64, 2 packed sequences per step.
inline TrainConfig small_config(at::ScalarType dtype, int64_t steps, MeshShape mesh = {1, 1, 1, 0}) {
  TrainConfig c;
  c.model = decoder_preset("test");
  c.mesh = mesh;
  c.dtype = dtype;
  c.seq_len = 64;
  c.batch = 2;
  c.steps = steps;
  c.seed = 7;
  c.corpus_path = shipped_corpus();
  return c;
}

// What a run leaves for comparison: its loss per step and this rank's final parameters.
struct RunResult {
  std::vector<double> losses;
  std::vector<std::string> names;
  std::vector<at::Tensor> parameters;
};

inline RunResult train_to_end(Trainer& trainer) {
  RunResult r;
  while (!trainer.done()) r.losses.push_back(trainer.step().loss);
  for (const auto& item : trainer.model()->named_parameters()) {
    r.names.push_back(item.key());
    r.parameters.push_back(item.value().detach().clone());
  }
  return r;
}

// File form: [losses, p0, p1, ...] (names are implied by the model's fixed parameter order).
inline void save_result(const RunResult& r, const std::string& path) {
  std::vector<at::Tensor> tensors{at::tensor(r.losses, at::kDouble)};
  tensors.insert(tensors.end(), r.parameters.begin(), r.parameters.end());
  torch::save(tensors, path);
}

inline RunResult load_result(const std::string& path) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, path);
  RunResult r;
  const at::Tensor losses = tensors.front().contiguous();
  r.losses.assign(losses.data_ptr<double>(), losses.data_ptr<double>() + losses.numel());
  r.parameters.assign(tensors.begin() + 1, tensors.end());
  return r;
}

// Runs `config` on config.mesh's world of forked ranks; rank 0 saves its result to `path`.
inline bool run_training(const TrainConfig& config, const std::string& path) {
  const int world = static_cast<int>(config.mesh.dp * config.mesh.cp * config.mesh.tp);
  return mlacp::test::run_ranks(world, [&](int rank, int world_size, const std::string& store) {
    ParallelGroups groups = mlacp::test::make_groups(rank, world_size, store, config.mesh);
    Trainer trainer(config, groups);
    const RunResult result = train_to_end(trainer);
    if (rank == 0) save_result(result, path);
  });
}

// The TP-local slice of a full (tp = 1) parameter (see MlaAttentionImpl::shard_heads_for_tp).
inline at::Tensor tp_slice(const std::string& name, const at::Tensor& full, const DecoderConfig& config,
                           int64_t tp_rank, int64_t tp) {
  if (tp == 1 || !DecoderLmImpl::is_tp_split(name)) return full;
  const MlaConfig& a = config.attention;
  const int64_t heads = a.num_heads / tp;
  if (name.size() >= 13 && name.compare(name.size() - 13, 13, "o_proj.weight") == 0)
    return full.narrow(1, tp_rank * heads * a.v_head_dim, heads * a.v_head_dim);
  const int64_t rows = full.size(0) / tp;
  return full.narrow(0, tp_rank * rows, rows);
}

// max |a - b| / max |b|
inline double relative_error(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  const double scale = std::max(y.abs().max().item<double>(), 1e-300);
  return (x - y).abs().max().item<double>() / scale;
}

inline double max_relative_loss_error(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = a.size() == b.size() ? 0.0 : INFINITY;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return worst;
}

}  // namespace mlacp::train::test
