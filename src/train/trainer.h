// The training loop of `mlacp train` (docs/DESIGN.md §7): a DecoderLm on this rank's CP shard of packed
// byte sequences, AdamW, exact gradient reduction, global-norm clipping, checkpoints.
//
// One step:
//   global batch (same on every rank) -> this rank's rows (DP) and tokens (CP)
//   loss_local = sum of this rank's token cross-entropies / global label count
//   backward -> reduce_gradients (sum over CP and DP; over TP only for TP-replicated attention
//   parameters) -> every parameter gradient equals the single-process gradient
//   global gradient norm (TP-split parameters summed over TP) -> clip -> AdamW (lr warmup)
//   loss = sum of loss_local over CP and DP (the single-process loss)
//
// Every check of the configuration (degrees, plan, divisibility, corpus, resume) runs in
// prepare_training(), before any collective, so bad input gives the same error on every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "mlacp/comm.h"
#include "mlacp/memory.h"
#include "mlacp/plan.h"
#include "mlacp/checkpoint.h"
#include "train/checkpoint_folder.h"
#include "train/data.h"
#include "train/hf_decoder.h"
#include "train/model.h"

namespace mlacp::train {

struct OptimizerConfig {
  double lr = 3e-3;          // peak learning rate
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1; // on matrices (dim >= 2) only
  int64_t warmup_steps = 5;  // lr ramps linearly over these steps, then stays at `lr`
  double grad_clip = 1.0;    // max global gradient norm; 0 = no clipping
  // The learning rate of step `step` (1-based); depends on nothing else, so resuming is exact.
  double lr_at(int64_t step) const;
};

struct TrainConfig {
  DecoderConfig model = decoder_preset("small");
  MeshShape mesh;                                        // dp x cp x tp (ulysses 0 = cp)
  CpStrategy strategy = CpStrategy::latent_kv_head;
  CpPartition partition = CpPartition::head_tail;
  bool overlap = false;
  bool recompute = false;  // recompute each decoder layer's activations in the backward (identical results)
  bool kv_recompute = false;  // latent strategy: K/V expanded per head sub-block, again in the backward
  at::ScalarType dtype = at::kFloat;  // kDouble, kFloat, or kBFloat16 (float32 parameters, bf16 autocast)
  // Where the model, the batches and the optimizer state live (this rank's GPU for --device cuda;
  // the groups must move tensors there). bf16 autocast runs on this device's type.
  // device: the default; mlacp train --device sets the rank's
  c10::Device device{c10::DeviceType::CPU};
  int64_t seq_len = 256;              // global packed sequence length S
  int64_t batch = 1;                  // packed sequences per step (global; split over DP)
  int64_t steps = 50;                 // the run ends after this step (a resumed run continues to it)
  uint64_t seed = 0;                  // parameters and data order
  OptimizerConfig optimizer;
  std::string corpus_path;            // file or folder; empty: default_corpus_path()
  std::string checkpoint_dir;         // empty: no checkpoints
  int64_t checkpoint_every = 0;       // also save every N steps (0: only after the last step)
  bool resume = false;                // continue from checkpoint_dir
  // With resume: a damaged newest generation falls back to the newest complete older one
  // (read_checkpoint_meta's accept_fallback) instead of being an error.
  bool resume_fallback = false;
  // A HuggingFace checkpoint folder (config.json + safetensors) to initialise every parameter
  // from instead of the seed (train/hf_decoder.h); `model` must be load_hf_decoder_config(it).
  // A new run only: not with `resume`.
  std::string hf_checkpoint;
  std::string describe() const;      // one line with every setting
};

// A validated configuration and its data, built without any collective.
struct PreparedTraining {
  TrainConfig config;
  std::shared_ptr<const PackedCorpus> data;
  std::optional<CheckpointMeta> resume_from;
  std::vector<std::string> resume_passed_over;  // damaged newer generations (resume_fallback only)
  std::optional<HfCheckpoint> hf_checkpoint;  // opened and checked (no tensor data read yet)
  std::optional<HfDecoderInit> hf_init;       // what the check found
};
// Checks, in this order: dtype, model, mesh against world_size, the CP plan, sequence length
// divisibility for the partition, batch divisibility by dp, optimizer numbers, steps, the
// HuggingFace checkpoint to initialise from (not with resume; the model config is its
// config.json's; every tensor present with its shape: check_hf_decoder_checkpoint), the corpus
// (present, at least one sequence), the checkpoint to resume (read_checkpoint_meta: a damaged one
// is an error of kind fault, the others of kind input). Throws mlacp::Error.
PreparedTraining prepare_training(const TrainConfig& config, int64_t world_size);

// Peak bytes one rank holds while training `config` (include/mlacp/memory.h): the parameters
// with their gradients and AdamW's two moments, every layer's saved activations, the logits,
// and one layer's attention working set. From shapes alone: checked before the first tensor.
MemoryEstimate training_memory(const TrainConfig& config);

// One step's numbers (also one line of the JSONL log).
struct StepRecord {
  int64_t step = 0;            // 1-based
  double loss = 0.0;           // mean cross-entropy per label token, nats (global)
  double grad_norm = 0.0;      // global norm before clipping
  double lr = 0.0;
  int64_t tokens = 0;          // global tokens in the step (B*S)
  double step_seconds = 0.0;   // this rank's wall time for the step
  double tokens_per_second = 0.0;
  double elapsed_seconds = 0.0;  // since the trainer was built
  std::string to_json() const;   // one line: step, loss, tokens_per_s, grad_norm, lr, tokens, step_s, time_s
  static StepRecord from_json(const std::string& line);
};

// How closely a loss curve follows the single-process run of the same settings (maximum over
// steps of |loss - loss_single| / |loss_single|). A float64 or float32 parallel run differs only
// by summation order (measured: ~5e-16 and ~2e-7 over 20/50 steps). bf16 autocast (bf16 GEMMs,
// float32 parameters, gradients and loss) is held to kLossAgreementBf16 against the float32
// single-process run, and a bf16 parallel run to the same bound against the bf16 single run:
// measured 2e-4 to 7e-4 over 50 steps at S=64..256 (tests/train, mlacp train --compare), so
// the bound leaves a 20x margin for longer runs and other seeds.
constexpr double kLossAgreementFloat64 = 1e-9;
constexpr double kLossAgreementFloat32 = 1e-4;
constexpr double kLossAgreementBf16 = 1e-2;
double loss_agreement_tolerance(at::ScalarType dtype);
// Maximum relative difference of two loss curves over the steps both have (`common` receives
// their count; 0 common steps gives +inf).
double max_relative_loss_difference(const std::vector<StepRecord>& run, const std::vector<StepRecord>& reference,
                                    int64_t* common = nullptr);
// Reads a JSONL log written by mlacp train (throws mlacp::Error when missing or malformed).
// `drop_torn_last_line`: a last line without its newline that does not parse (a write cut by a
// kill) is left out instead of rejected (a resumed run's own log).
std::vector<StepRecord> read_step_log(const std::string& path, bool drop_torn_last_line = false);

class Trainer {
 public:
  // `groups` must have the shape of config.mesh. Builds the model from the seed (identical on
  // every rank), loads the HuggingFace checkpoint into it when one is given (every rank, before
  // TP sharding), shards TP heads, installs CP (the first collective), builds AdamW, and resumes
  // from the checkpoint when asked.
  Trainer(PreparedTraining prepared, const ParallelGroups& groups);
  Trainer(const TrainConfig& config, const ParallelGroups& groups);

  // Runs step current_step()+1; saves a checkpoint when one is due (collective on every rank).
  // `recorded` gets the step's record first, before that checkpoint: a log written there holds
  // every step a checkpoint holds, so a kill between the two never leaves a resumed log a gap.
  StepRecord step(const std::function<void(const StepRecord&)>& recorded = {});
  bool done() const { return step_ >= config_.steps; }
  int64_t current_step() const { return step_; }
  int64_t data_position() const { return sampler_.position(); }
  // Writes checkpoint_dir (every rank calls it; ranks with dp_rank = cp_rank = 0 write their TP
  // shard; world rank 0 writes meta.json last).
  void save_checkpoint();

  DecoderLm& model() { return model_; }
  const TrainConfig& config() const { return config_; }
  const PackedCorpus& data() const { return *data_; }
  const ParallelGroups& groups() const { return groups_; }
  // What was loaded from config.hf_checkpoint (nullopt without one).
  const std::optional<HfDecoderInit>& hf_init() const { return hf_init_; }

 private:
  at::Tensor forward_backward(const LocalBatch& local);
  at::Tensor clip_gradients();  // the global norm before clipping, on the device
  void load_checkpoint(const CheckpointMeta& meta);

  TrainConfig config_;
  std::shared_ptr<const PackedCorpus> data_;
  ParallelGroups groups_;
  DecoderLm model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  BatchSampler sampler_;
  int64_t step_ = 0;
  double started_ = 0.0;
  std::optional<HfDecoderInit> hf_init_;
};

}  // namespace mlacp::train
