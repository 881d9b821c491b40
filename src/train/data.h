// Training data for `mlacp train`: a byte-level tokenizer, the shipped text corpus, documents
// packed into global sequences of S tokens (with global document ends, so packed-sequence
// attention is exercised), a deterministic batch order, and the split of a global batch onto
// DP rows and CP shards.
//
// Labels are computed on the global token stream before any sharding: the label of token i is
// token i+1 of the same document (also when i+1 lies in another CP shard or in the next packed
// sequence), and kIgnoreLabel at a document's last token.
// Owns: tokens, labels, document boundaries, data position. Does not own: the model or ranks.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "mlacp/plan.h"

namespace mlacp::train {

// Bytes are tokens: id = byte value.
struct ByteTokenizer {
  static constexpr int64_t kVocabSize = 256;
  static std::vector<int64_t> encode(std::string_view text);
  static std::string decode(const std::vector<int64_t>& ids);  // ids outside [0, 256) are errors
};

// The label of a document's last token (cross-entropy ignores it).
constexpr int64_t kIgnoreLabel = -100;

// Documents in a fixed order.
struct Corpus {
  std::vector<std::string> documents;
  std::string source;  // where it was read from
  int64_t total_bytes() const;
};

// A corpus file, or a folder whose `*.txt` files are read in name order. A document is one
// paragraph: text between blank lines (lines of only whitespace count as blank), with its
// line breaks kept. Throws mlacp::Error when the path is missing or holds no text.
Corpus load_corpus(const std::string& path);
// The corpus shipped in data/corpus/, searched next to the executable (build dir or above) and
// in the working directory; throws mlacp::Error naming the places it looked.
std::string default_corpus_path();

// One packed global sequence of S tokens.
struct PackedSequence {
  std::vector<int64_t> tokens;         // [S] token ids
  std::vector<int64_t> labels;         // [S] next token of the same document, or kIgnoreLabel
  std::vector<int64_t> document_ends;  // exclusive ends of the document pieces, last = S
};

// The corpus as one token stream (documents back to back) cut into floor(tokens / S) sequences.
// A document cut by a sequence boundary continues in the next sequence with positions restarting
// at 0 there; its label across the cut is still the true next token.
class PackedCorpus {
 public:
  // Throws mlacp::Error when the corpus holds fewer than S tokens (not one full sequence).
  PackedCorpus(const Corpus& corpus, int64_t seq_len);
  int64_t seq_len() const { return seq_len_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  PackedSequence sequence(int64_t index) const;

 private:
  int64_t seq_len_;
  int64_t num_sequences_;
  std::vector<uint8_t> tokens_;       // the whole stream
  std::vector<int32_t> document_of_;  // document index of every stream token
};

// A global batch: B packed sequences (every rank builds the same one).
struct GlobalBatch {
  at::Tensor tokens;                                // [B, S] int64
  at::Tensor labels;                                // [B, S] int64 (kIgnoreLabel where masked)
  std::vector<std::vector<int64_t>> document_ends;  // per row
  int64_t label_count = 0;                          // labels != kIgnoreLabel in the whole batch
};

// Sequences in a deterministic shuffled order: epoch e visits every sequence once in the order
// of a Fisher-Yates shuffle seeded by (seed, e). The position is the number of sequences handed
// out so far; it is all a checkpoint needs to resume the same order.
class BatchSampler {
 public:
  BatchSampler(const PackedCorpus& corpus, int64_t batch, uint64_t seed);
  GlobalBatch next();
  int64_t position() const { return position_; }
  void set_position(int64_t position);

 private:
  int64_t sequence_at(int64_t position);
  const PackedCorpus* corpus_;
  int64_t batch_;
  uint64_t seed_;
  int64_t position_ = 0;
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;
};

// This rank's part of a global batch: rows [dp_rank*B/dp, (dp_rank+1)*B/dp) and, of each, the
// tokens of CP rank cp_rank under the partition (mlacp::shard_sequence). Document ends stay
// global (the CP runtime takes global ends).
struct LocalBatch {
  at::Tensor tokens;                                // [B/dp, S_l] int64
  at::Tensor labels;                                // [B/dp, S_l] int64
  std::vector<std::vector<int64_t>> document_ends;  // per local row, global
  int64_t global_label_count = 0;                   // loss normaliser: labels over the global batch
};
LocalBatch shard_batch(const GlobalBatch& batch, CpPartition partition, int64_t cp, int64_t cp_rank, int64_t dp,
                       int64_t dp_rank);

}  // namespace mlacp::train
