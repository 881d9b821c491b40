#include "train/data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <ATen/ATen.h>

#include "mlacp/errors.h"
#include "mlacp/runtime.h"

namespace mlacp::train {
namespace {

namespace fs = std::filesystem;
constexpr const char* kWhat = "training data";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MLACP_REQUIRE(in.good(), kWhat, "corpus file must be readable", {got("path", path.string())},
                "check the path and its permissions");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool blank(std::string_view line) { return line.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos; }

// Paragraphs of a text: runs of non-blank lines, each line with its '\n'.
void split_paragraphs(const std::string& text, std::vector<std::string>& documents) {
  std::string current;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    end = end == std::string::npos ? text.size() : end + 1;
    const std::string_view line(text.data() + start, end - start);
    if (blank(line)) {
      if (!current.empty()) documents.push_back(std::move(current));
      current.clear();
    } else {
      current.append(line);
    }
    start = end;
  }
  if (!current.empty()) documents.push_back(std::move(current));
}

}  // namespace

std::vector<int64_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    MLACP_REQUIRE(ids[i] >= 0 && ids[i] < kVocabSize, "byte tokenizer", "token ids must lie in [0, 256)",
                  {got("index", i), got("id", ids[i])}, "decode ids produced by this tokenizer");
    text[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
  }
  return text;
}

int64_t Corpus::total_bytes() const {
  int64_t total = 0;
  for (const auto& d : documents) total += static_cast<int64_t>(d.size());
  return total;
}

Corpus load_corpus(const std::string& path) {
  std::error_code ec;
  MLACP_REQUIRE(!path.empty() && fs::exists(path, ec), kWhat, "the corpus path must exist", {got("corpus", path)},
                "pass --corpus FILE|DIR (the shipped corpus is data/corpus/ in the source tree)");
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::directory_iterator(path, ec))
      if (entry.is_regular_file() && entry.path().extension() == ".txt") files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    MLACP_REQUIRE(!files.empty(), kWhat, "a corpus folder must hold at least one *.txt file", {got("corpus", path)},
                  "put text files named *.txt in it, or pass one file");
  } else {
    files.push_back(path);
  }
  Corpus corpus;
  corpus.source = path;
  for (const auto& file : files) split_paragraphs(read_file(file), corpus.documents);
  MLACP_REQUIRE(!corpus.documents.empty(), kWhat, "the corpus must hold some text",
                {got("corpus", path), got("files", files.size())}, "use a corpus with at least one paragraph");
  return corpus;
}

std::string default_corpus_path() {
  std::vector<fs::path> candidates;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path().parent_path() / "share" / "mlacp" / "corpus");  // installed: bin/../share
    for (fs::path dir = exe.parent_path(); !dir.empty(); dir = dir.parent_path()) {
      candidates.push_back(dir / "data" / "corpus");
      if (candidates.size() >= 5 || dir == dir.root_path()) break;
    }
  }
#ifdef MLACP_SOURCE_CORPUS_DIR
  candidates.push_back(MLACP_SOURCE_CORPUS_DIR);  // the source tree this build was configured from
#endif
  candidates.push_back(fs::current_path(ec) / "data" / "corpus");
  std::string looked;
  for (const auto& c : candidates) {
    if (fs::is_directory(c, ec)) return c.string();
    looked += (looked.empty() ? "" : " ") + c.string();
  }
  fail(kWhat, "the shipped corpus (data/corpus/) was not found", {got("looked_in", looked)},
       "pass --corpus FILE|DIR, or run from the source tree");
}

// ---------------------------------------------------------------------------------------------
PackedCorpus::PackedCorpus(const Corpus& corpus, int64_t seq_len) : seq_len_(seq_len) {
  MLACP_REQUIRE(seq_len > 0, kWhat, "sequence length must be > 0", {got("seq_len", seq_len)}, "pass --seq N");
  for (size_t d = 0; d < corpus.documents.size(); ++d) {
    const std::string& doc = corpus.documents[d];
    tokens_.insert(tokens_.end(), doc.begin(), doc.end());
    document_of_.insert(document_of_.end(), doc.size(), static_cast<int32_t>(d));
  }
  num_sequences_ = num_tokens() / seq_len;
  MLACP_REQUIRE(num_sequences_ >= 1, kWhat, "the corpus is too small for one sequence",
                {got("corpus_tokens", num_tokens()), got("seq_len", seq_len), got("corpus", corpus.source)},
                "use a larger corpus or a shorter --seq");
}

PackedSequence PackedCorpus::sequence(int64_t index) const {
  MLACP_REQUIRE(index >= 0 && index < num_sequences_, kWhat, "sequence index out of range",
                {got("index", index), got("num_sequences", num_sequences_)}, "");
  PackedSequence s;
  const int64_t begin = index * seq_len_;
  s.tokens.resize(seq_len_);
  s.labels.resize(seq_len_);
  for (int64_t i = 0; i < seq_len_; ++i) {
    const int64_t t = begin + i;
    s.tokens[i] = tokens_[t];
    const bool has_next = t + 1 < num_tokens() && document_of_[t + 1] == document_of_[t];
    s.labels[i] = has_next ? tokens_[t + 1] : kIgnoreLabel;
    const bool piece_ends = i + 1 == seq_len_ || document_of_[t + 1] != document_of_[t];
    if (piece_ends) s.document_ends.push_back(i + 1);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
BatchSampler::BatchSampler(const PackedCorpus& corpus, int64_t batch, uint64_t seed)
    : corpus_(&corpus), batch_(batch), seed_(seed) {
  MLACP_REQUIRE(batch > 0, kWhat, "batch must be > 0", {got("batch", batch)}, "pass --batch N");
}

void BatchSampler::set_position(int64_t position) {
  MLACP_REQUIRE(position >= 0, kWhat, "data position must be >= 0", {got("position", position)}, "");
  position_ = position;
}

int64_t BatchSampler::sequence_at(int64_t position) {
  const int64_t n = corpus_->num_sequences();
  const int64_t epoch = position / n;
  if (epoch != order_epoch_) {
    // std::mt19937_64's output is fixed by the standard; the distribution is ours (modulo), so
    // the order is the same with every standard library.
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) + 1);
    order_.resize(n);
    for (int64_t i = 0; i < n; ++i) order_[i] = i;
    for (int64_t i = n - 1; i > 0; --i) std::swap(order_[i], order_[rng() % static_cast<uint64_t>(i + 1)]);
    order_epoch_ = epoch;
  }
  return order_[position % n];
}

GlobalBatch BatchSampler::next() {
  const int64_t s = corpus_->seq_len();
  GlobalBatch out;
  std::vector<int64_t> tokens, labels;
  tokens.reserve(batch_ * s);
  labels.reserve(batch_ * s);
  for (int64_t b = 0; b < batch_; ++b) {
    PackedSequence seq = corpus_->sequence(sequence_at(position_++));
    tokens.insert(tokens.end(), seq.tokens.begin(), seq.tokens.end());
    labels.insert(labels.end(), seq.labels.begin(), seq.labels.end());
    out.document_ends.push_back(std::move(seq.document_ends));
  }
  out.label_count = std::count_if(labels.begin(), labels.end(), [](int64_t l) { return l != kIgnoreLabel; });
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  out.tokens = at::tensor(tokens, long_options).view({batch_, s});  // [B, S]
  out.labels = at::tensor(labels, long_options).view({batch_, s});  // [B, S]
  return out;
}

LocalBatch shard_batch(const GlobalBatch& batch, CpPartition partition, int64_t cp, int64_t cp_rank, int64_t dp,
                       int64_t dp_rank) {
  const int64_t rows = batch.tokens.size(0);
  MLACP_REQUIRE(dp >= 1 && rows % dp == 0, kWhat, "batch must be divisible by dp (each DP rank takes B/dp rows)",
                {got("batch", rows), got("dp", dp)}, "choose a batch that dp divides");
  check_shardable(partition, batch.tokens.size(1), cp);
  const int64_t local_rows = rows / dp, first = dp_rank * local_rows;
  LocalBatch local;
  local.tokens = shard_sequence(batch.tokens.narrow(0, first, local_rows), partition, cp, cp_rank);  // [B/dp, S_l]
  local.labels = shard_sequence(batch.labels.narrow(0, first, local_rows), partition, cp, cp_rank);  // [B/dp, S_l]
  local.document_ends.assign(batch.document_ends.begin() + first, batch.document_ends.begin() + first + local_rows);
  local.global_label_count = batch.label_count;
  return local;
}

}  // namespace mlacp::train
