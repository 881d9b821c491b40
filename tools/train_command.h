// `mlacp train`: trains a small DeepSeek-style decoder (MLA attention) on the shipped byte-level
// corpus with context parallelism, end to end.
//   mlacp train                        4 local ranks, cp = 4 (default layout), float32
//   mlacp train --compare              the README run: the CP training (4 ranks, cp=4), then the
//                                      same steps on 1 rank without CP; prints the maximum
//                                      relative difference of the loss curves, both runs'
//                                      tokens/s and the plot path; exit 1 if the curves disagree
//   mlacp train --cp 2 --tp 2 --strategy expanded --dtype bfloat16 --steps 100 --log run.jsonl
//   mlacp train --checkpoint ckpt --steps 100 --resume    continue a run (--resume-fallback: past a
//                                      damaged newest generation, from the newest complete one)
//   mlacp train --hf-checkpoint DIR --steps 100          start from a HuggingFace checkpoint's weights
// Under torchrun (RANK/WORLD_SIZE set) it runs as one rank of that launch.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "device_options.h"

namespace mlacp::tools {

struct TrainArgs {
  // layout
  int nproc = 4;
  std::optional<int64_t> cp;  // default: world / (dp * tp)
  int64_t dp = 1, tp = 1;
  std::string ulysses = "0";                // a number (0: U = P) or "auto"
  std::string strategy = "latent_kv_head";  // or "auto": the planner's choice (plan_command.h)
  std::string plan_hardware;                // with auto: a profile or hardware file ("": calibrate)
  std::string partition = "head_tail";
  bool overlap = false;
  bool recompute = false;
  bool kv_recompute = false;
  // model and data
  std::string preset = "small";
  bool preset_given = false;  // --preset was on the command line
  std::string config_path;
  std::optional<int64_t> layers;
  std::string hf_checkpoint;  // HuggingFace checkpoint folder: config and initial parameters
  std::string corpus;  // empty: the shipped data/corpus/
  // run
  std::string dtype = "float32";
  int64_t steps = 50, seq = 256, batch = 1, seed = 0;
  double lr = 3e-3, weight_decay = 0.1, clip = 1.0;
  int64_t warmup = 5;
  std::string checkpoint;
  int64_t checkpoint_every = 0;
  bool resume = false;
  bool resume_fallback = false;  // with --resume: a damaged newest generation falls back to an older one
  // output
  std::string log;        // one JSON line per step
  std::string plot;       // PNG of the loss curve(s) (gnuplot)
  std::string reference;  // a reference run's JSONL log, overlaid and compared
  bool compare = false;
  std::string out_dir = "mlacp-train";  // --compare: where its logs (and default plot) go
  int timeout_s = 300;
  DeviceArgs device;  // --device, --backend
  std::string progress_log;  // internal (hidden --progress-log): the launcher's copy of the log
};

CLI::App* add_train_command(CLI::App& app, TrainArgs& args);
int run_train(const CommonArgs& common, const TrainArgs& args);

}  // namespace mlacp::tools
