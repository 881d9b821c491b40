// A training checkpoint folder on disk (docs/DESIGN.md §8 "Checkpoints"): one generation folder
// per save, meta.json in each, and which generation --resume takes. The tensors inside a
// generation (one archive per TP shard) are the trainer's; this module names the files, writes
// and checks meta.json, and switches and prunes generations, always by renaming a folder first,
// so that a kill at any moment leaves only names it can tell apart:
//   DIR/.step-N.partial/   a save in progress (the shards, then meta.json): ignored; the next save removes it
//   DIR/step-N/            a complete generation, switched in by one rename after its meta.json
//   DIR/.step-N.pruning/   a generation being removed (renamed, then removed): ignored; removed likewise
// A step-N/ that is not complete was therefore damaged after it was written, never by a kill:
// resuming from its folder is an error naming the damaged file (or, when asked, a fallback to
// the newest complete older generation, said aloud). A folder written before generations
// existed (meta.json and the shards directly in DIR) is read as one generation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlacp::train {

// What a checkpoint records besides tensors (each generation's meta.json). A checkpoint can be
// resumed under another dp/cp/strategy/partition, but not another tp or model.
struct CheckpointMeta {
  int64_t step = 0;
  int64_t data_position = 0;  // sequences consumed
  int64_t tp = 1;
  std::string model;          // DecoderConfig::describe()
  int64_t seq_len = 0;
  int64_t batch = 0;
  std::string dtype;
  uint64_t seed = 0;
  std::string folder;         // the generation folder holding it
};

// Complete generations kept after each save (the newest ones; older folders are pruned).
constexpr int kKeptCheckpoints = 2;

// The archive of TP shard `tp_rank` of `tp` in a generation folder ("tp0-of-2.pt").
std::string shard_file(const std::string& folder, int64_t tp_rank, int64_t tp);

// The generation --resume continues from: the newest generation folder of `dir` when it is
// complete (meta.json with its typed fields, the folder's step, every shard present and a whole
// archive: its zip directory intact). Throws mlacp::Error:
//  - kind input: `dir` holds no generation folder at all (nothing to resume);
//  - kind fault: the newest is damaged, naming the damaged file, what is wrong with it and the
//    newest complete older generation (if any). With `accept_fallback` that older generation is
//    returned instead, and each damaged newer one is described in `passed_over` ("DIR/step-N:
//    ..."); the damaged folders stay where they are.
CheckpointMeta read_checkpoint_meta(const std::string& dir, bool accept_fallback = false,
                                    std::vector<std::string>* passed_over = nullptr);

// Complete generations of `dir`, oldest first (damaged and half-written folders left out).
std::vector<CheckpointMeta> complete_generations(const std::string& dir);

// The folder a save of `step` writes its shards into before the switch (DIR/.step-N.partial).
std::string partial_folder(const std::string& dir, int64_t step);

// The two halves of a save's folder work, run by one process (the trainer's world rank 0):
// - begin_generation: `dir` created, what killed saves and prunes left removed, a fresh empty
//   partial_folder(dir, step); returns why it could not be made ("" when it was). Never throws
//   (the other ranks wait at a barrier for it).
// - commit_generation: writes `meta` (and the one-line `layout`) as the partial folder's
//   meta.json, switches it in as step-N/ (an earlier step-N/ is renamed away first), then prunes
//   every generation folder older than the newest kKeptCheckpoints complete ones, and a
//   pre-generation checkpoint in `dir` itself once two generations exist. Throws mlacp::Error
//   when meta.json cannot be written.
std::string begin_generation(const std::string& dir, int64_t step);
void commit_generation(const std::string& dir, const CheckpointMeta& meta, const std::string& layout);

}  // namespace mlacp::train
