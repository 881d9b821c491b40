// `mlacp train` (see train_command.h). Three roles:
//   rank      launched (torchrun variables set): build the groups, train, rank 0 writes the log,
//             the plot and the summary;
//   launcher  otherwise: validate everything once, start --nproc local ranks, draw the progress
//             bar from the log rank 0 writes (it tails an internal copy of it);
//   compare   --compare: launcher twice (the parallel layout, then 1 rank without CP), then
//             compare the two loss curves and plot them.
#include "train_command.h"
#include "plan_command.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>

#include "core/format.h"
#include "launcher.h"
#include "memory_check.h"
#include "option_checks.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "table.h"
#include "temp_files.h"
#include "train/trainer.h"
#include "core/threads.h"

namespace mlacp::tools {
namespace {

namespace fs = std::filesystem;
using train::StepRecord;
constexpr const char* kWhat = "train";
constexpr const char* kProgressLogOption = "--progress-log";  // internal: the launcher's copy of the log

// ---- configuration ---------------------------------------------------------------------------

train::TrainConfig build_config(const TrainArgs& a, int64_t world_size) {
  train::TrainConfig c;
  if (!a.hf_checkpoint.empty()) {
    std::vector<ErrorValue> shape_flags;  // flags that would change the loaded shapes
    if (a.preset_given) shape_flags.push_back(got("preset", a.preset));
    if (!a.config_path.empty()) shape_flags.push_back(got("config", a.config_path));
    if (a.layers) shape_flags.push_back(got("layers", *a.layers));
    if (!shape_flags.empty()) {
      shape_flags.insert(shape_flags.begin(), got("hf_checkpoint", a.hf_checkpoint));
      fail(kWhat,
           "--hf-checkpoint takes the model from its config.json and weights: --preset, --config and --layers "
           "cannot go with it",
           shape_flags, "drop --preset/--config/--layers: the checkpoint decides the model's shape");
    }
    c.model = train::load_hf_decoder_config(a.hf_checkpoint);
    c.hf_checkpoint = a.hf_checkpoint;
  } else {
    c.model = a.config_path.empty() ? train::decoder_preset(a.preset) : train::load_decoder_config(a.config_path);
    if (a.layers) c.model.num_layers = *a.layers;
  }
  c.mesh.dp = a.dp;
  c.mesh.tp = a.tp;
  c.mesh.cp = a.cp.value_or(std::max<int64_t>(1, world_size / std::max<int64_t>(1, a.dp * a.tp)));
  c.mesh.ulysses = parse_count(kWhat, "ulysses", a.ulysses);
  c.strategy = parse_strategy(a.strategy);
  c.partition = parse_partition(a.partition);
  c.overlap = a.overlap;
  c.recompute = a.recompute;
  c.kv_recompute = a.kv_recompute;
  c.dtype = parse_dtype(a.dtype);
  c.seq_len = a.seq;
  c.batch = a.batch;
  c.steps = a.steps;
  c.seed = static_cast<uint64_t>(a.seed);
  c.optimizer.lr = a.lr;
  c.optimizer.weight_decay = a.weight_decay;
  c.optimizer.grad_clip = a.clip;
  c.optimizer.warmup_steps = a.warmup;
  c.corpus_path = a.corpus;
  c.checkpoint_dir = a.checkpoint;
  c.checkpoint_every = a.checkpoint_every;
  c.resume = a.resume;
  c.resume_fallback = a.resume_fallback;
  return c;
}

std::string layout_label(const train::TrainConfig& c) {
  std::ostringstream out;
  if (c.mesh.cp == 1 && c.mesh.tp == 1 && c.mesh.dp == 1) {
    out << "single process";
  } else {
    out << "dp=" << c.mesh.dp << " cp=" << c.mesh.cp << " tp=" << c.mesh.tp;
    if (c.mesh.cp > 1) out << " U=" << (c.mesh.ulysses == 0 ? c.mesh.cp : c.mesh.ulysses) << " " << strategy_name(c.strategy);
  }
  out << ", " << dtype_name(c.dtype);
  return out.str();
}

// ---- plots -----------------------------------------------------------------------------------

std::string find_gnuplot() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const fs::path candidate = fs::path(dir.empty() ? "." : dir) / "gnuplot";
    if (access(candidate.c_str(), X_OK) == 0) return candidate.string();
  }
  return "";
}

void require_gnuplot() {
  MLACP_REQUIRE(!find_gnuplot().empty(), kWhat, "--plot needs gnuplot on the PATH", {got("PATH", std::getenv("PATH") ? std::getenv("PATH") : "")},
                "apt-get install gnuplot-nox (scripts/setup.sh does), or drop --plot");
}

std::string quoted(const std::string& s) {  // a gnuplot / shell single-quoted string
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

struct Curve {
  std::string title;
  std::vector<StepRecord> records;
};

// Loss against step, one line per curve, written by gnuplot to `png`.
void write_loss_plot(const std::string& png, const std::string& title, const std::vector<Curve>& curves) {
  require_gnuplot();
  const fs::path work = owned_temp_path("plot");  // a kill's leftover goes at the next launch
  fs::create_directories(work);
  std::ostringstream script;
  script << "set terminal pngcairo size 960,560 font ',11'\nset output " << quoted(png) << "\n"
         << "set title " << quoted(title) << " noenhanced\nset xlabel 'step'\nset ylabel 'loss (nats per token)'\n"
         << "set grid\nset key top right noenhanced\nplot ";
  for (size_t i = 0; i < curves.size(); ++i) {
    const fs::path data = work / ("curve" + std::to_string(i) + ".dat");
    std::ofstream out(data);
    out << std::setprecision(17);
    for (const auto& r : curves[i].records) out << r.step << " " << r.loss << "\n";
    script << (i ? ", " : "") << quoted(data.string()) << " using 1:2 with lines lw " << (i == 0 ? 3 : 2)
           << (i == 0 ? "" : " dt 2") << " title " << quoted(curves[i].title);
  }
  script << "\n";
  const fs::path script_path = work / "plot.gp";
  std::ofstream(script_path) << script.str();
  const std::string command = quoted(find_gnuplot()) + " " + quoted(script_path.string()) + " 2>&1";
  std::string output;
  int status = -1;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char buf[512];
    while (fgets(buf, sizeof buf, pipe)) output += buf;
    status = pclose(pipe);
  }
  fs::remove_all(work);
  MLACP_REQUIRE(status == 0, kWhat, "gnuplot failed to write the plot",
                {got("png", png), got("status", status), got("output", output.substr(0, 300))},
                "check that the plot's folder exists and is writable");
}

// ---- progress --------------------------------------------------------------------------------

std::string clock_text(double seconds) {
  const int64_t s = static_cast<int64_t>(std::max(0.0, std::round(seconds)));
  std::ostringstream out;
  out << s / 60 << ":" << std::setw(2) << std::setfill('0') << s % 60;
  return out.str();
}

std::string rate_text(double tokens_per_second) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (tokens_per_second >= 1e3) out << tokens_per_second / 1e3 << "k"; else out << tokens_per_second;
  return out.str();
}

// Mean tokens/s over a run, leaving out the first step (start-up) when there are others.
double mean_tokens_per_second(const std::vector<StepRecord>& records) {
  double tokens = 0.0, seconds = 0.0;
  for (size_t i = records.size() > 1 ? 1 : 0; i < records.size(); ++i) {
    tokens += static_cast<double>(records[i].tokens);
    seconds += records[i].step_seconds;
  }
  return seconds > 0.0 ? tokens / seconds : 0.0;
}

// A progress bar on stderr: redrawn in place on a terminal, else one line per tenth of the run.
class Progress {
 public:
  Progress(std::string label, int64_t total_steps)
      : label_(std::move(label)), total_(std::max<int64_t>(1, total_steps)), tty_(isatty(STDERR_FILENO) == 1) {}

  void update(const StepRecord& r) {
    if (first_step_ < 0) first_step_ = r.step;
    if (r.step > first_step_) {
      timed_seconds_ += r.step_seconds;
      ++timed_steps_;
    }
    const double per_step = timed_steps_ > 0 ? timed_seconds_ / timed_steps_ : r.step_seconds;
    const int64_t width = 24, filled = std::min<int64_t>(width, width * r.step / total_);
    std::ostringstream line;
    line << "train " << label_ << " [" << std::string(filled, '#') << std::string(width - filled, '.') << "] "
         << r.step << "/" << total_ << "  loss " << std::fixed << std::setprecision(4) << r.loss << "  "
         << rate_text(r.tokens_per_second) << " tok/s  ETA " << clock_text(per_step * (total_ - r.step));
    const int64_t tenth = 10 * r.step / total_;
    if (tty_) {
      std::cerr << "\r\033[K" << line.str() << std::flush;
      drawn_ = true;
    } else if (tenth != last_tenth_ || r.step == total_) {
      std::cerr << line.str() << "\n" << std::flush;
      last_tenth_ = tenth;
    }
  }
  void finish() {
    if (tty_ && drawn_) std::cerr << "\n" << std::flush;
    drawn_ = false;
  }

 private:
  std::string label_;
  int64_t total_;
  bool tty_;
  bool drawn_ = false;
  int64_t first_step_ = -1, last_tenth_ = -1, timed_steps_ = 0;
  double timed_seconds_ = 0.0;
};

// Follows a JSONL log while the ranks write it, feeding each new record to a Progress.
class LogFollower {
 public:
  LogFollower(std::string path, Progress& progress) : path_(std::move(path)), progress_(progress) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        poll();
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      poll();
      progress_.finish();
    });
  }
  ~LogFollower() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 private:
  void poll() {
    std::ifstream in(path_, std::ios::binary);
    if (!in.good()) return;
    in.seekg(0, std::ios::end);
    const std::streamoff size = in.tellg();
    if (size < offset_) offset_ = 0;  // rewritten
    in.seekg(offset_);
    std::string chunk(static_cast<size_t>(size - offset_), '\0');
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const size_t last_newline = chunk.rfind('\n');
    if (last_newline == std::string::npos) return;
    offset_ += static_cast<std::streamoff>(last_newline + 1);
    std::istringstream lines(chunk.substr(0, last_newline + 1));
    for (std::string line; std::getline(lines, line);) {
      try {
        progress_.update(StepRecord::from_json(line));
      } catch (const Error&) {
      }
    }
  }
  std::string path_;
  Progress& progress_;
  std::streamoff offset_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// ---- logs ------------------------------------------------------------------------------------

// Opens a log for appending step records: truncated for a fresh run; for a resumed run the
// records up to the resumed step are kept (so the file stays one continuous curve).
std::ofstream open_log(const std::string& path, int64_t resumed_step) {
  std::vector<StepRecord> kept;
  if (resumed_step > 0 && fs::exists(path)) {
    for (const auto& r : train::read_step_log(path, /*drop_torn_last_line=*/true))
      if (r.step <= resumed_step) kept.push_back(r);
  }
  std::ofstream out(path, std::ios::trunc);
  MLACP_REQUIRE(out.good(), kWhat, "cannot write the log file", {got("log", path)}, "choose a writable path");
  for (const auto& r : kept) out << r.to_json() << "\n";
  out.flush();
  return out;
}

// ---- rank ------------------------------------------------------------------------------------

// Everything a rank can check alone, before the first collective (same result on every rank).
// A --reference log: readable and holding at least one step (checked before any training).
std::vector<train::StepRecord> read_reference_log(const std::string& path) {
  std::vector<train::StepRecord> records = train::read_step_log(path);
  MLACP_REQUIRE(!records.empty(), kWhat, "the --reference log holds no step", {got("reference", path)},
                "pass a log written by mlacp train --log FILE.jsonl");
  return records;
}

// `local_ranks`: the ranks this host runs (the launcher's --nproc, or LOCAL_WORLD_SIZE for a rank).
train::PreparedTraining prepare_rank(const TrainArgs& args, int64_t world_size, int64_t local_ranks) {
  check_device_args(args.device, local_ranks, kWhat);
  train::PreparedTraining prepared = train::prepare_training(build_config(args, world_size), world_size);
  if (!args.plot.empty()) require_gnuplot();
  if (!args.reference.empty()) read_reference_log(args.reference);
  return prepared;
}

// The end-of-run report: summary, the reference comparison and the plot. `curve` is the whole
// log (with a resumed run's earlier steps), `records` the steps this run made.
void report_run(const TrainArgs& args, const train::TrainConfig& config, const std::vector<StepRecord>& records,
                const std::vector<StepRecord>& curve) {
  std::ostringstream summary;
  if (!records.empty()) {
    summary << "train: " << records.size() << " steps (" << records.front().step << "-" << records.back().step
            << ") in " << fixed(records.back().elapsed_seconds, 1) << " s; loss " << fixed(curve.front().loss, 4)
            << " -> " << fixed(records.back().loss, 4) << "; " << rate_text(mean_tokens_per_second(records))
            << " tokens/s (" << layout_label(config) << ")\n";
  }
  if (!args.log.empty()) summary << "train: log " << args.log << "\n";
  if (!config.checkpoint_dir.empty() && !records.empty())
    summary << "train: checkpoint " << config.checkpoint_dir << " (step " << records.back().step << ")\n";
  std::vector<Curve> curves{{layout_label(config), curve}};
  if (!args.reference.empty()) {
    Curve reference{"reference " + fs::path(args.reference).filename().string(), read_reference_log(args.reference)};
    int64_t common_steps = 0;
    const double diff = train::max_relative_loss_difference(curve, reference.records, &common_steps);
    MLACP_REQUIRE(common_steps > 0, kWhat, "the --reference log shares no step with this run",
                  {got("reference", args.reference), got("reference_steps", static_cast<int64_t>(reference.records.size()))},
                  "pass the log of a run over the same steps");
    summary << "train: against " << args.reference << ": max relative loss difference " << sci(diff) << " over "
            << common_steps << " common steps\n";
    curves.push_back(std::move(reference));
  }
  if (!args.plot.empty()) {
    write_loss_plot(args.plot, "mlacp train: " + config.model.describe(), curves);
    summary << "train: plot " << args.plot << "\n";
  }
  std::cout << summary.str() << std::flush;
}

// Intra-op threads of a training rank: --threads when given, else 1. The models `train` runs
// here are small (GEMMs of 64..256 wide): a second intra-op thread per process made a 1-rank run
// 3-30x slower on a busy 2-core host (OpenBLAS pthreads: 14k -> 0.4-4.9k tokens/s at S=256),
// and several ranks per host already share the cores.
void set_rank_threads(const CommonArgs& common) {
  if (common.threads > 0) {
    apply_threads(common);
  } else {
    set_intra_op_threads(1);
  }
}

// One rank of a launch. Rank 0 writes --log and, when started by this command's own launcher,
// the launcher's copy (--progress-log): then the launcher draws the progress bar and reports;
// otherwise (torchrun) rank 0 does both itself.
// `used`: where to put the configuration the run had (its Ulysses degree resolved on the hosts).
int run_as_rank(const CommonArgs& common, const TrainArgs& args, train::TrainConfig* used = nullptr) {
  set_rank_threads(common);
  const WorldInfo world = world_from_env();
  train::PreparedTraining prepared = prepare_rank(args, world.size, local_world_size(world));
  // The memory check covers host memory: on a GPU the tensors are the device's (README "GPU").
  if (!args.device.cuda()) check_run_memory(common, kWhat, train::training_memory(prepared.config), 0);
  prepared.config.device = rank_device(args.device, world);
  const GroupOptions options = group_options_for(args.device, prepared.config.device, args.timeout_s);
  Rendezvous rendezvous = Rendezvous::of(world, options.timeout);
  // --ulysses 0 (the default) on several hosts: the Ulysses groups inside a host (comm.h)
  if (parse_count(kWhat, "ulysses", args.ulysses) == 0)
    prepared.config.mesh.ulysses = host_local_ulysses(prepared.config.mesh, rendezvous.topology());
  const train::TrainConfig config = prepared.config;
  if (used) *used = config;
  const bool lead = world.rank == 0;
  const bool own_report = args.progress_log.empty();
  const int64_t resumed = prepared.resume_from ? prepared.resume_from->step : 0;
  const std::string resumed_from = prepared.resume_from ? prepared.resume_from->folder : "";
  std::string passed_over;  // --resume-fallback: the damaged newer generations, said with the resume
  for (const std::string& damaged : prepared.resume_passed_over) passed_over += "; passed over the damaged " + damaged;

  ParallelGroups groups = rendezvous.groups(config.mesh, options);
  if (lead) std::cerr << "train: " << config.describe() << "\ntrain: " << groups.describe() << "\n";
  train::Trainer trainer(std::move(prepared), groups);
  if (lead && trainer.hf_init()) std::cerr << "train: " << trainer.hf_init()->describe() << "\n";

  std::ofstream log, copy;
  std::unique_ptr<Progress> progress;
  std::vector<StepRecord> records;
  if (lead) {
    if (!args.log.empty()) log = open_log(args.log, resumed);
    if (!args.progress_log.empty()) copy = open_log(args.progress_log, resumed);
    if (own_report) progress = std::make_unique<Progress>(layout_label(config), config.steps);
    if (resumed > 0)
      std::cerr << "train: resumed from " << resumed_from << " (the newest complete checkpoint) at step "
                << resumed << passed_over << "\n";
  }
  while (!trainer.done()) {
    // The record is written before the step's checkpoint (a kill between them leaves the log a
    // step ahead of the newest checkpoint, which a resume trims, never a step behind).
    const StepRecord r = trainer.step([&](const StepRecord& record) {
      if (!lead) return;
      for (std::ofstream* out : {&log, &copy})
        if (out->is_open()) *out << record.to_json() << "\n" << std::flush;
    });
    if (!lead) continue;
    records.push_back(r);
    if (progress) progress->update(r);
  }
  if (!lead || !own_report) return 0;
  if (progress) progress->finish();
  report_run(args, config, records, args.log.empty() ? records : train::read_step_log(args.log));
  return 0;
}

// ---- launcher --------------------------------------------------------------------------------

// This command line without the launcher's options and the ones in `drop` (each with its value),
// for the ranks; `extra` appended.
std::vector<std::string> rank_arguments(const CommonArgs& common, const std::set<std::string>& drop_with_value,
                                        const std::set<std::string>& drop_flags, const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  for (size_t i = 1; i < common.argv.size(); ++i) {
    const std::string& a = common.argv[i];
    const std::string name = a.substr(0, a.find('='));
    if (drop_flags.count(name)) continue;
    if (drop_with_value.count(name)) {
      if (name == a) ++i;  // "--opt value"; "--opt=value" is one word
      continue;
    }
    out.push_back(a);
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

std::string temp_log_path(const std::string& tag) {
  return owned_temp_path("train") + "-" + tag + ".jsonl";  // a kill's leftover goes at the next launch
}

// Launches `nproc` local ranks with `args` while drawing the progress bar from `follow_log`.
int launch_with_progress(int nproc, const std::vector<std::string>& args, const std::string& follow_log,
                         const std::string& label, int64_t total_steps) {
  Progress progress(label, total_steps);
  LogFollower follower(follow_log, progress);
  LaunchOptions options;
  options.nproc = nproc;
  const int status = launch_local(options, args);
  follower.stop();
  return status;
}

// `prepared`: prepare_rank of `args` (errors once, before any launch).
int run_launcher(const CommonArgs& common, const TrainArgs& args, const train::PreparedTraining& prepared) {
  if (!args.device.cuda()) check_run_memory(common, kWhat, train::training_memory(prepared.config), args.nproc);
  const int64_t resumed = prepared.resume_from ? prepared.resume_from->step : 0;
  const std::string follow = temp_log_path("progress");
  fs::remove(follow);
  struct RemoveAtExit {  // also when reading it or reporting throws
    std::string path;
    ~RemoveAtExit() {
      std::error_code ec;
      fs::remove(path, ec);
    }
  } remove_follow{follow};
  if (resumed > 0 && !args.log.empty() && fs::exists(args.log))  // rank 0 keeps its records up to `resumed`
    fs::copy_file(args.log, follow, fs::copy_options::overwrite_existing);
  const std::vector<std::string> rank_args =
      rank_arguments(common, {"--nproc", kProgressLogOption}, {}, {kProgressLogOption, follow});
  const int status =
      launch_with_progress(args.nproc, rank_args, follow, layout_label(prepared.config), prepared.config.steps);
  if (status == 0) {
    const std::vector<StepRecord> curve = train::read_step_log(follow);
    std::vector<StepRecord> records;
    for (const auto& r : curve)
      if (r.step > resumed) records.push_back(r);
    report_run(args, prepared.config, records, curve);
  }
  fs::remove(follow);
  return status;
}

// ---- compare ---------------------------------------------------------------------------------

// The single-process run of --compare under torchrun, in this process over a world of one.
void train_alone(const TrainArgs& single, const std::string& log_path) {
  train::PreparedTraining prepared = prepare_rank(single, 1, 1);
  WorldInfo alone;
  prepared.config.device = rank_device(single.device, alone);
  const std::string store = owned_temp_path("train-alone") + "-store";
  struct RemoveAtExit {
    std::string path;
    ~RemoveAtExit() {
      std::error_code ec;
      fs::remove(path, ec);
    }
  } remove_store{store};
  const GroupOptions options = group_options_for(single.device, prepared.config.device, single.timeout_s);
  ParallelGroups groups = create_parallel_groups_file(store, alone, prepared.config.mesh, options);
  const train::TrainConfig config = prepared.config;
  train::Trainer trainer(std::move(prepared), groups);
  std::ofstream log = open_log(log_path, 0);
  Progress progress(layout_label(config), config.steps);
  while (!trainer.done()) {
    const StepRecord r = trainer.step([&](const StepRecord& record) { log << record.to_json() << "\n" << std::flush; });
    progress.update(r);
  }
  progress.finish();
}

// The two curves of --compare, side by side: the table, agreement within the dtype's tolerance,
// the plot. Exit code: 0 when they agree.
int compare_runs(const CommonArgs& common, const TrainArgs& args, const train::TrainConfig& parallel, int64_t ranks,
                 const std::string& parallel_log, const std::string& single_log, const std::string& plot) {
  const std::vector<StepRecord> a = train::read_step_log(parallel_log), b = train::read_step_log(single_log);
  int64_t common_steps = 0;
  const double diff = train::max_relative_loss_difference(a, b, &common_steps);
  const double tolerance = train::loss_agreement_tolerance(parallel.dtype);
  const bool agree = diff <= tolerance && common_steps == parallel.steps;
  std::vector<Curve> curves{{layout_label(parallel) + " (" + std::to_string(ranks) + " ranks)", a},
                            {"single process (1 rank)", b}};
  if (!args.reference.empty()) curves.push_back({"reference", read_reference_log(args.reference)});
  write_loss_plot(plot, "mlacp train --compare: " + parallel.model.describe(), curves);

  Table table({"run", "ranks", "final loss", "tokens/s", "time s"});
  const std::pair<std::pair<std::string, int64_t>, const std::vector<StepRecord>*> rows[] = {
      {{layout_label(parallel), ranks}, &a}, {{"single process", 1}, &b}};
  for (const auto& [run, records] : rows) {
    table.add({run.first, std::to_string(run.second), fixed(records->back().loss, 6),
               fixed(mean_tokens_per_second(*records), 0), fixed(records->back().elapsed_seconds, 1)});
  }
  table.print(std::cout);
  std::cout << "loss curves: max relative difference " << sci(diff) << " over " << common_steps << " steps (tolerance "
            << sci(tolerance) << " for " << dtype_name(parallel.dtype) << "): " << (agree ? "agree" : "DISAGREE")
            << "\n"
            << "tokens/s: parallel / single = " << fixed(mean_tokens_per_second(a) / mean_tokens_per_second(b), 2)
            << " (" << (launched_as_rank() ? std::to_string(ranks) + " ranks under torchrun"
                                           : std::to_string(ranks) + " ranks share this machine's " +
                                                 std::to_string(std::thread::hardware_concurrency()) + " cores")
            << "; " << (common.threads == 0 ? 1 : common.threads) << " intra-op thread(s) per rank in both runs)\n"
            << "logs: " << parallel_log << " " << single_log << "\nplot: " << plot << "\n";
  return agree ? 0 : 1;
}

// Both runs use the ranks' thread default (set_rank_threads: 1 per rank unless --threads).
int run_compare(const CommonArgs& common, const TrainArgs& args) {
  MLACP_REQUIRE(args.checkpoint.empty() && !args.resume, kWhat, "--compare runs fresh trainings without checkpoints",
                {got("checkpoint", args.checkpoint), got("resume", args.resume)}, "drop --checkpoint/--resume");
  TrainArgs single = args;
  single.dp = single.tp = 1;
  single.cp = 1;
  single.ulysses = "0";
  single.plot.clear();
  single.reference.clear();
  TrainArgs parallel = single;
  parallel.dp = args.dp;
  parallel.tp = args.tp;
  parallel.cp = args.cp;
  parallel.ulysses = args.ulysses;
  parallel.compare = single.compare = false;
  const train::PreparedTraining p = prepare_rank(parallel, args.nproc, args.nproc);
  const train::PreparedTraining s = prepare_rank(single, 1, 1);
  if (!args.device.cuda()) {
    check_run_memory(common, kWhat, train::training_memory(p.config), args.nproc);  // the runs take turns
    check_run_memory(common, kWhat, train::training_memory(s.config), 1);
  }
  if (!args.reference.empty()) read_reference_log(args.reference);
  fs::create_directories(args.out_dir);
  const std::string parallel_log = (fs::path(args.out_dir) / "train-parallel.jsonl").string();
  const std::string single_log = (fs::path(args.out_dir) / "train-single.jsonl").string();
  const std::string plot = args.plot.empty() ? (fs::path(args.out_dir) / "loss.png").string() : args.plot;
  require_gnuplot();
  const std::set<std::string> drop = {"--nproc", "--cp", "--dp", "--tp", "--ulysses", "--log",
                                      "--plot",  "--reference", "--out", kProgressLogOption};
  std::cerr << "train --compare: " << p.config.describe() << "\n";
  struct Run {
    int nproc;
    const train::TrainConfig* config;
    std::string log;
    std::vector<std::string> layout;
  };
  const Run runs[] = {
      {args.nproc, &p.config, parallel_log,
       {"--dp", std::to_string(p.config.mesh.dp), "--cp", std::to_string(p.config.mesh.cp), "--tp",
        std::to_string(p.config.mesh.tp), "--ulysses", std::to_string(p.config.mesh.ulysses)}},
      {1, &s.config, single_log, {"--dp", "1", "--cp", "1", "--tp", "1", "--ulysses", "0"}}};
  for (const Run& run : runs) {
    fs::remove(run.log);
    std::vector<std::string> extra = run.layout;
    extra.insert(extra.end(), {kProgressLogOption, run.log});  // rank 0 writes it; this process reports
    const std::vector<std::string> arguments = rank_arguments(common, drop, {"--compare"}, extra);
    const int status = launch_with_progress(run.nproc, arguments, run.log,
                                            layout_label(*run.config) + " (" + std::to_string(run.nproc) + " rank" +
                                                (run.nproc > 1 ? "s" : "") + ")",
                                            run.config->steps);
    if (status != 0) return status;
  }
  return compare_runs(common, args, p.config, args.nproc, parallel_log, single_log, plot);
}

// --compare under torchrun (ranks on one host or several): the ranks train the layout, rank 0
// writing its log; then rank 0 alone trains the same steps on one process without CP (here, over a
// world of one) and compares the curves as the local --compare does. The other ranks are done
// after the layout's run. Every rule of both runs is checked on every rank before the first
// collective.
int run_compare_as_rank(const CommonArgs& common, const TrainArgs& args) {
  MLACP_REQUIRE(args.checkpoint.empty() && !args.resume, kWhat, "--compare runs fresh trainings without checkpoints",
                {got("checkpoint", args.checkpoint), got("resume", args.resume)}, "drop --checkpoint/--resume");
  const WorldInfo world = world_from_env();
  const std::string parallel_log = (fs::path(args.out_dir) / "train-parallel.jsonl").string();
  const std::string single_log = (fs::path(args.out_dir) / "train-single.jsonl").string();
  const std::string plot = args.plot.empty() ? (fs::path(args.out_dir) / "loss.png").string() : args.plot;
  TrainArgs parallel = args, single = args;
  parallel.compare = single.compare = false;
  parallel.plot.clear();
  parallel.reference.clear();
  parallel.log = parallel_log;
  single = parallel;
  single.dp = single.tp = 1;
  single.cp = 1;
  single.ulysses = "0";
  single.log = single_log;
  const train::PreparedTraining s = prepare_rank(single, 1, 1);  // its rules too, on every rank
  if (!args.device.cuda()) check_run_memory(common, kWhat, train::training_memory(s.config), 0);
  if (!args.reference.empty()) read_reference_log(args.reference);
  if (world.rank == 0) {
    require_gnuplot();
    fs::create_directories(args.out_dir);
    fs::remove(single_log);
  }
  train::TrainConfig layout;
  const int status = run_as_rank(common, parallel, &layout);
  if (status != 0 || world.rank != 0) return status;
  std::cerr << "train --compare: the same steps on this rank alone, without CP\n";
  train_alone(single, single_log);
  return compare_runs(common, args, layout, world.size, parallel_log, single_log, plot);
}

}  // namespace

// ---- command ---}  // namespace

// ---- command ---------------------------------------------------------------------------------

CLI::App* add_train_command(CLI::App& app, TrainArgs& args) {
  CLI::App* cmd = app.add_subcommand("train", "train a small MLA decoder on the shipped corpus with context parallelism");
  auto* layout = cmd->add_option_group("layout", "ranks and parallel degrees (world = dp x cp x tp)");
  layout->add_option("--nproc", args.nproc, "local ranks to launch (ignored under torchrun)")->check(int_range(1, 64))->capture_default_str();
  layout->add_option("--cp", args.cp, "context-parallel degree P (default: world / (dp*tp))")
      ->check(int_range(1, 65536));
  layout->add_option("--dp", args.dp, "data-parallel degree")->capture_default_str()->check(int_range(1, 65536));
  layout->add_option("--tp", args.tp, "tensor-parallel degree (attention heads)")
      ->capture_default_str()
      ->check(int_range(1, 65536));
  layout->add_option("--ulysses", args.ulysses, "Ulysses degree U (0: U = P on one host; on several, the largest U whose Ulysses groups stay inside a host), or auto (the planner's choice)")
      ->capture_default_str();
  layout->add_option("--strategy", args.strategy, "expanded_ulysses | latent_kv_head | auto (the planner's choice)")
      ->capture_default_str();
  add_plan_hardware_option(layout, args.plan_hardware);
  layout->add_option("--partition", args.partition, "contiguous | head_tail (needs 2P | S)")->capture_default_str();
  layout->add_flag("--overlap", args.overlap, "overlap schedules (identical results)");
  layout->add_flag("--recompute", args.recompute,
                   "recompute each decoder layer's activations in its backward: less memory, one more forward "
                   "(identical results)");
  layout->add_flag("--kv-recompute", args.kv_recompute,
                   "latent strategy: expand each layer's K/V a few heads at a time, again in the backward, instead of "
                   "keeping them (less memory, one more kv_b_proj pass, identical results)");
  auto* model = cmd->add_option_group("model and data");
  model->add_option("--preset", args.preset, "decoder preset: small | test")
      ->capture_default_str()
      ->each([&args](const std::string&) { args.preset_given = true; });
  model->add_option("--config", args.config_path, "HuggingFace-style config.json instead of a preset")
      ->check(input_file());
  model->add_option("--hf-checkpoint", args.hf_checkpoint,
                    "HuggingFace checkpoint folder (config.json + safetensors) of a dense DeepSeek-V3-style decoder "
                    "with vocab_size 256: the model's config and every initial parameter (a new run, not --resume)")
      ->check(input_folder());
  model->add_option("--layers", args.layers, "number of decoder layers (overrides the preset/config)")
      ->check(int_range(1, 1024));
  model->add_option("--corpus", args.corpus, "corpus file or folder of *.txt (default: the shipped data/corpus/)")
      ->check(input_path());
  auto* run = cmd->add_option_group("run");
  run->add_option("--dtype", args.dtype, "float64 | float32 | bfloat16 (float32 parameters, bf16 autocast)")->capture_default_str();
  run->add_option("--steps", args.steps, "last training step")->capture_default_str();
  run->add_option("--seq", args.seq, "packed sequence length S (global, split over CP)")->capture_default_str();
  run->add_option("--batch", args.batch, "packed sequences per step (global, split over DP)")->capture_default_str();
  run->add_option("--lr", args.lr, "peak learning rate (AdamW)")->check(positive())->capture_default_str();
  run->add_option("--warmup", args.warmup, "linear learning-rate warmup steps")->capture_default_str();
  run->add_option("--weight-decay", args.weight_decay, "AdamW weight decay on matrices")
      ->check(non_negative())
      ->capture_default_str();
  run->add_option("--clip", args.clip, "max global gradient norm (0: off)")->check(non_negative())->capture_default_str();
  run->add_option("--seed", args.seed, "seed of parameters and data order")->capture_default_str();
  run->add_option("--checkpoint", args.checkpoint, "checkpoint folder (written after the last step)")
      ->check(output_folder());
  run->add_option("--checkpoint-every", args.checkpoint_every, "also write the checkpoint every N steps")->capture_default_str();
  run->add_flag("--resume", args.resume, "continue from the checkpoint in --checkpoint (its newest generation)");
  run->add_flag("--resume-fallback", args.resume_fallback,
                "with --resume: when the newest generation is damaged (an error otherwise), resume from the newest "
                "complete older one and name the damaged ones");
  add_timeout_option(run, args.timeout_s, "collective timeout in seconds (a dead peer is an error after it)");
  add_device_options(run, args.device);
  auto* out = cmd->add_option_group("output");
  out->add_option("--log", args.log, "write one JSON line per step (step, loss, tokens_per_s, grad_norm, time_s)")
      ->check(output_file());
  out->add_option("--plot", args.plot, "write the loss curve(s) as PNG (gnuplot)")->check(output_file());
  out->add_option("--reference", args.reference, "a reference run's JSONL log: overlaid on the plot and compared")
      ->check(input_file());
  out->add_flag("--compare", args.compare,
                "train with the layout (default 4 ranks, cp=4), then on 1 rank without CP; compare the loss curves");
  out->add_option("--out", args.out_dir, "--compare: folder for both logs and the default plot")
      ->check(output_folder())
      ->capture_default_str();
  // Internal: the launcher's copy of the log, which it follows for the progress bar.
  cmd->add_option(kProgressLogOption, args.progress_log, "")->group("");
  return cmd;
}

// --strategy auto / --ulysses auto: the planner's choice for one decoder layer's attention at the
// run's S, batch per CP group, degrees and dtype (partition as given; overlap too when --overlap
// is not given). The launcher resolves it once and passes the choice to the ranks.
int run_train_auto(const CommonArgs& common, const TrainArgs& args) {
  MLACP_REQUIRE(!launched_as_rank() || !args.plan_hardware.empty(), kWhat,
                "--strategy/--ulysses auto under torchrun needs --plan-hardware (a calibration per rank could choose "
                "differently on each)",
                {}, "write one with mlacp plan --calibrate --save-hardware FILE and pass --plan-hardware FILE");
  TrainArgs probe = args;
  probe.strategy = "latent_kv_head";
  probe.ulysses = "0";
  const train::TrainConfig c = build_config(probe, launched_as_rank() ? world_from_env().size : args.nproc);
  AutoPlanQuery q;
  q.config = c.model.attention;
  q.seq_len = c.seq_len;
  q.batch = std::max<int64_t>(1, c.batch / std::max<int64_t>(1, c.mesh.dp));
  q.cp = c.mesh.cp;
  q.tp = c.mesh.tp;
  q.dtype = dtype_name(c.dtype);
  if (args.strategy != "auto") q.strategy = parse_strategy(args.strategy);
  if (args.ulysses != "auto") {
    const int64_t u = parse_count(kWhat, "ulysses", args.ulysses);
    q.ulysses = u == 0 ? c.mesh.cp : u;
  }
  q.partition = c.partition;
  if (args.overlap) q.overlap = true;
  q.hardware = args.plan_hardware;
  q.memory_bytes_per_rank = auto_plan_memory_per_rank(common, args.device.cuda(), args.nproc);
  q.cpu_run = !args.device.cuda();
  const PlanReport report = plan_for_auto(q);
  const CandidatePrediction& choice = report.choice();
  if (!launched_as_rank() || world_from_env().rank == 0) std::cout << auto_choice_text(report) << std::flush;
  TrainArgs chosen = args;
  chosen.kv_recompute = args.kv_recompute || choice.spec.kv_recompute;  // the planner's, when memory is short
  chosen.strategy = strategy_name(choice.spec.strategy);
  chosen.ulysses = std::to_string(choice.spec.ulysses);
  chosen.overlap = choice.spec.overlap;
  chosen.plan_hardware.clear();
  CommonArgs with = common;
  with.argv = with_planned_choice(common.argv, {{"--strategy", chosen.strategy}, {"--ulysses", chosen.ulysses}});
  if (chosen.overlap) with.argv = with_planned_flag(with.argv, "--overlap");
  if (chosen.kv_recompute) with.argv = with_planned_flag(with.argv, "--kv-recompute");
  return run_train(with, chosen);
}

// When the run's estimate exceeds the memory limit: the recomputation that makes it fit, the
// cheapest first: the latent strategy's K/V (--kv-recompute, one more kv_b_proj pass per layer),
// each decoder layer (--recompute, one more forward), both. The launcher decides for all its ranks
// and hands the flags on; under torchrun each rank would decide alone, so there they stay the
// user's. Nothing fits: unchanged (the memory check then names the estimate and the ways out).
int launch_within_memory(const CommonArgs& common, const TrainArgs& args) {
  const MemoryLimit limit = memory_limit(common);
  train::PreparedTraining prepared = prepare_rank(args, args.nproc, args.nproc);
  if (args.device.cuda() || !limit.enforced) return run_launcher(common, args, prepared);
  const train::TrainConfig config = prepared.config;
  const double ranks = static_cast<double>(args.nproc);
  auto need = [&](bool kv, bool layers) {
    train::TrainConfig c = config;
    c.kv_recompute = c.kv_recompute || kv;
    c.recompute = c.recompute || layers;
    return train::training_memory(c).total() * ranks;
  };
  if (need(false, false) <= limit.bytes) return run_launcher(common, args, prepared);
  const bool kv_possible = config.strategy == CpStrategy::latent_kv_head && config.mesh.cp > 1 && !config.kv_recompute;
  const std::pair<bool, bool> choices[] = {{true, false}, {false, true}, {true, true}};
  for (const auto& [kv, layers] : choices) {
    if ((kv && !kv_possible) || (layers && config.recompute) || need(kv, layers) > limit.bytes) continue;
    CommonArgs with = common;
    TrainArgs chosen = args;
    std::string flags;
    for (const auto& [on, flag] : {std::pair<bool, const char*>{kv, "--kv-recompute"}, {layers, "--recompute"}}) {
      if (!on) continue;
      with.argv.push_back(flag);
      flags += (flags.empty() ? "" : " ") + std::string(flag);
    }
    chosen.kv_recompute = chosen.kv_recompute || kv;
    chosen.recompute = chosen.recompute || layers;
    std::cout << "train: memory: the estimate " << format_bytes(need(false, false)) << " for " << args.nproc
              << " ranks exceeds the limit " << format_bytes(limit.bytes) << " (" << limit.source << "); with " << flags
              << " it is " << format_bytes(need(kv, layers)) << ": running with " << flags << "\n"
              << std::flush;
    prepared.config.kv_recompute = chosen.kv_recompute;
    prepared.config.recompute = chosen.recompute;
    return run_launcher(with, chosen, prepared);
  }
  return run_launcher(common, args, prepared);
}

int run_train(const CommonArgs& common, const TrainArgs& args) {
  if (args.strategy == "auto" || args.ulysses == "auto") return run_train_auto(common, args);
  if (launched_as_rank()) return args.compare ? run_compare_as_rank(common, args) : run_as_rank(common, args);
  if (args.compare) return run_compare(common, args);
  return launch_within_memory(common, args);
}

}  // namespace mlacp::tools
