#include "train/checkpoint_folder.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>

#include "mlacp/errors.h"

namespace mlacp::train {
namespace {

namespace fs = std::filesystem;
constexpr const char* kWhat = "train";
constexpr const char* kMetaFile = "meta.json";
const std::string kNamePrefix = "step-";

std::string generation_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return name;
}

// ".<name><suffix>": the name of a folder that is no generation (.step-N.partial, .step-N.pruning).
// (Appended piece by piece: GCC 12 warns falsely about "." + std::string at -O2.)
std::string hidden_name(const std::string& name, const char* suffix) {
  std::string hidden = ".";
  hidden += name;
  hidden += suffix;
  return hidden;
}

// The step a generation folder's name carries ("step-00000012" -> 12), or -1 for any other name.
int64_t step_of_name(const std::string& name) {
  const std::string digits = name.rfind(kNamePrefix, 0) == 0 ? name.substr(kNamePrefix.size()) : "";
  if (digits.empty() || digits.size() > 18) return -1;
  for (char c : digits)
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
  return std::stoll(digits);
}

// One generation folder as found: complete (`meta`) or damaged (`file` and what is wrong with it).
struct Generation {
  int64_t step = -1;  // the folder name's (a pre-generation folder: its meta.json's, or -1)
  fs::path folder;
  std::optional<CheckpointMeta> meta;
  std::string file, problem;
};

// "" when `file` is a whole PyTorch archive: its zip directory, at the end of the file, is read
// (a truncated file, or a file of another kind, has none); its tensors are not.
std::string archive_problem(const std::string& file) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(file);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return "it is not a whole PyTorch archive (" + what.substr(0, what.find('\n')) + ")";
  }
  return "";
}

// `named_step`: the step of the folder's name, which meta.json must record (-1: a pre-generation
// folder, whose meta.json decides).
Generation read_generation(const fs::path& folder, int64_t named_step) {
  Generation g;
  g.step = named_step;
  g.folder = folder;
  const auto damaged = [&g](const fs::path& file, std::string problem) {
    g.file = file.string();
    g.problem = std::move(problem);
    return g;
  };
  const fs::path path = folder / kMetaFile;
  std::ifstream in(path);
  if (!in.good()) return damaged(path, "it is missing or unreadable");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object()) return damaged(path, "it is not a JSON object");
  for (const char* field : {"step", "data_position", "tp"})
    if (!j.contains(field) || !j.at(field).is_number_integer())
      return damaged(path, std::string("\"") + field + "\" is missing or not an integer");
  for (const char* field : {"seq_len", "batch", "seed"})
    if (j.contains(field) && !j.at(field).is_number_integer())
      return damaged(path, std::string("\"") + field + "\" is not an integer");
  for (const char* field : {"model", "dtype"})
    if (j.contains(field) && !j.at(field).is_string())
      return damaged(path, std::string("\"") + field + "\" is not a string");
  CheckpointMeta m;
  m.step = j.at("step").get<int64_t>();
  m.data_position = j.at("data_position").get<int64_t>();
  m.tp = j.at("tp").get<int64_t>();
  if (m.step < 0 || m.data_position < 0 || m.tp < 1)
    return damaged(path, "step and data_position must be >= 0 and tp >= 1");
  if (named_step >= 0 && m.step != named_step)
    return damaged(path, "it records step " + std::to_string(m.step) + ", not its folder's " + std::to_string(named_step));
  m.model = j.value("model", "");
  m.seq_len = j.value("seq_len", int64_t{0});
  m.batch = j.value("batch", int64_t{0});
  m.dtype = j.value("dtype", "");
  m.seed = j.value("seed", uint64_t{0});
  m.folder = folder.string();
  for (int64_t r = 0; r < m.tp; ++r) {
    const std::string shard = shard_file(m.folder, r, m.tp);
    std::error_code ec;
    if (!fs::is_regular_file(shard, ec)) return damaged(shard, "it is missing");
    if (std::string problem = archive_problem(shard); !problem.empty()) return damaged(shard, problem);
  }
  g.step = m.step;
  g.meta = m;
  return g;
}

// Every generation folder of `dir`, damaged ones too, oldest first (.partial and .pruning folders
// are not generations).
std::vector<Generation> scan_generations(const fs::path& dir) {
  std::vector<Generation> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  if (fs::exists(dir / kMetaFile, ec)) found.push_back(read_generation(dir, -1));
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t step = step_of_name(entry.path().filename().string());
    if (step >= 0 && entry.is_directory(ec)) found.push_back(read_generation(entry.path(), step));
  }
  std::stable_sort(found.begin(), found.end(), [](const Generation& a, const Generation& b) { return a.step < b.step; });
  return found;
}

// Removes a generation folder: renamed to .step-N.pruning first (one step), so that a kill
// midway leaves a name no reader takes for a generation (a rename that fails leaves it whole).
void prune(const fs::path& folder) {
  std::error_code ec;
  const fs::path doomed = folder.parent_path() / hidden_name(folder.filename().string(), ".pruning");
  fs::remove_all(doomed, ec);
  fs::rename(folder, doomed, ec);
  if (!ec) fs::remove_all(doomed, ec);
}

// What killed saves and prunes left in `dir`: .step-N.partial and .step-N.pruning folders.
void remove_leftovers(const fs::path& dir) {
  std::error_code ec;
  std::vector<fs::path> leftovers;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const auto ends_with = [&name](const std::string& tail) {
      return name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (name.rfind("." + kNamePrefix, 0) == 0 && (ends_with(".partial") || ends_with(".pruning")))
      leftovers.push_back(entry.path());
  }
  for (const fs::path& p : leftovers) fs::remove_all(p, ec);
}

}  // namespace

std::string partial_folder(const std::string& dir, int64_t step) {
  return (fs::path(dir) / hidden_name(generation_name(step), ".partial")).string();
}

std::string shard_file(const std::string& folder, int64_t tp_rank, int64_t tp) {
  return (fs::path(folder) / ("tp" + std::to_string(tp_rank) + "-of-" + std::to_string(tp) + ".pt")).string();
}

CheckpointMeta read_checkpoint_meta(const std::string& dir, bool accept_fallback, std::vector<std::string>* passed_over) {
  const std::vector<Generation> found = scan_generations(dir);
  MLACP_REQUIRE(!found.empty(), kWhat, "--resume needs a checkpoint: a generation folder (step-N/) in the checkpoint folder",
                {got("checkpoint", dir)}, "run once with --checkpoint DIR first, or drop --resume");
  const Generation& newest = found.back();
  if (newest.meta) return *newest.meta;
  const auto older = std::find_if(found.rbegin(), found.rend(), [](const Generation& g) { return g.meta.has_value(); });
  if (accept_fallback && older != found.rend()) {
    for (const Generation& g : found)
      if (g.step > older->step && passed_over) passed_over->push_back(g.file + ": " + g.problem);
    return *older->meta;
  }
  const std::string fallback =
      older == found.rend() ? "none" : older->folder.string() + " (step " + std::to_string(older->step) + ")";
  fail_fault(kWhat,
             "the newest checkpoint generation is damaged (not by a killed save: a save names its folder only after "
             "writing every file)",
             {got("checkpoint", dir), got("file", newest.file), got("problem", newest.problem),
              got("older_complete", fallback)},
             older == found.rend()
                 ? "no complete generation is left to fall back to: repair " + newest.folder.string() +
                       ", or start a new run without --resume"
                 : "pass --resume-fallback to resume from " + fallback + ", or repair or remove " + newest.folder.string());
}

std::vector<CheckpointMeta> complete_generations(const std::string& dir) {
  std::vector<CheckpointMeta> complete;
  for (const Generation& g : scan_generations(dir))
    if (g.meta) complete.push_back(*g.meta);
  return complete;
}

std::string begin_generation(const std::string& dir, int64_t step) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (fs::is_directory(dir, ec)) remove_leftovers(dir);
  const fs::path partial = partial_folder(dir, step);
  fs::create_directories(partial, ec);
  if (fs::is_directory(partial, ec)) return "";
  return ec ? ec.message() : "not a folder";
}

void commit_generation(const std::string& dir, const CheckpointMeta& meta, const std::string& layout) {
  const fs::path partial = partial_folder(dir, meta.step), complete = fs::path(dir) / generation_name(meta.step);
  const nlohmann::json j{{"step", meta.step},   {"data_position", meta.data_position},
                         {"tp", meta.tp},       {"model", meta.model},
                         {"seq_len", meta.seq_len}, {"batch", meta.batch},
                         {"dtype", meta.dtype}, {"seed", meta.seed},
                         {"layout", layout}};
  const fs::path file = partial / kMetaFile;
  {
    std::ofstream out(file.string() + ".tmp");
    out << j.dump(2) << "\n";
    out.flush();
    MLACP_REQUIRE(out.good(), kWhat, "cannot write the checkpoint's meta.json", {got("file", file.string())},
                  "check the free space of the checkpoint folder");
  }
  fs::rename(file.string() + ".tmp", file);
  std::error_code ec;
  if (fs::exists(complete, ec)) prune(complete);  // the same step saved again
  fs::rename(partial, complete);                  // the switch: one step
  const std::vector<Generation> found = scan_generations(dir);
  std::vector<int64_t> complete_steps;
  for (const Generation& g : found)
    if (g.meta) complete_steps.push_back(g.step);
  if (complete_steps.size() >= static_cast<size_t>(kKeptCheckpoints)) {
    const int64_t oldest_kept = complete_steps[complete_steps.size() - kKeptCheckpoints];
    for (const Generation& g : found)
      if (g.step < oldest_kept && g.folder != fs::path(dir)) prune(g.folder);
  }
  if (fs::exists(fs::path(dir) / kMetaFile, ec) && complete_steps.size() > 1) {  // a pre-generation checkpoint is superseded
    const auto root = std::find_if(found.begin(), found.end(), [&dir](const Generation& g) { return g.folder == fs::path(dir); });
    const int64_t tp = root != found.end() && root->meta ? root->meta->tp : meta.tp;
    fs::remove(fs::path(dir) / kMetaFile, ec);
    for (int64_t r = 0; r < tp; ++r) fs::remove(shard_file(dir, r, tp), ec);
  }
}

}  // namespace mlacp::train
