// Training data: tokenizer, corpus loading, packing with global document ends, labels computed
// before sharding, deterministic batch order and its resume position.
#include <fstream>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "train/data.h"
#include "train_support.h"

namespace mlacp::train {
namespace {

using ::testing::HasSubstr;

Corpus corpus_of(std::vector<std::string> documents) {
  Corpus c;
  c.documents = std::move(documents);
  c.source = "test";
  return c;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kLong);
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::vector<int64_t> ids = ByteTokenizer::encode(all);
  ASSERT_EQ(ids.size(), 256u);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[255], 255);
  EXPECT_EQ(ByteTokenizer::decode(ids), all);
  EXPECT_THROW(ByteTokenizer::decode({256}), Error);
}

TEST(Corpus, ShippedCorpusLoadsAsParagraphs) {
  const Corpus c = load_corpus(test::shipped_corpus());
  EXPECT_GT(c.documents.size(), 400u);
  EXPECT_GT(c.total_bytes(), 100000);
  EXPECT_LT(c.total_bytes(), 400000);  // "a few hundred KB at most"
  for (const auto& d : c.documents) {
    ASSERT_FALSE(d.empty());
    EXPECT_EQ(d.find("\n\n"), std::string::npos) << "a paragraph holds no blank line";
  }
}

TEST(Corpus, ParagraphsSplitOnBlankLines) {
  test::TempDir dir("paragraphs");
  std::ofstream(dir.file("a.txt")) << "one\ntwo\n\n  \nthree\n\n\nfour";
  std::ofstream(dir.file("b.md")) << "not read\n";
  const Corpus c = load_corpus(dir.path());
  EXPECT_EQ(c.documents, (std::vector<std::string>{"one\ntwo\n", "three\n", "four"}));
}

TEST(PackedCorpus, LabelsAreNextTokensOfTheSameDocument) {
  // stream: a b c | d e f g h | i j   (documents 0, 1, 2), S = 4 -> 2 sequences, "ij" dropped
  const PackedCorpus packed(corpus_of({"abc", "defgh", "ij"}), 4);
  ASSERT_EQ(packed.num_sequences(), 2);
  const PackedSequence s0 = packed.sequence(0);
  EXPECT_EQ(s0.tokens, (std::vector<int64_t>{'a', 'b', 'c', 'd'}));
  EXPECT_EQ(s0.labels, (std::vector<int64_t>{'b', 'c', kIgnoreLabel, 'e'}));  // 'd' continues in sequence 1
  EXPECT_EQ(s0.document_ends, (std::vector<int64_t>{3, 4}));
  const PackedSequence s1 = packed.sequence(1);
  EXPECT_EQ(s1.tokens, (std::vector<int64_t>{'e', 'f', 'g', 'h'}));
  EXPECT_EQ(s1.labels, (std::vector<int64_t>{'f', 'g', 'h', kIgnoreLabel}));
  EXPECT_EQ(s1.document_ends, (std::vector<int64_t>{4}));
}

TEST(PackedCorpus, LabelsAcrossCpShardBoundariesComeFromTheGlobalSequence) {
  // One document of 16 tokens, S = 16, cp = 4 head_tail: rank 0 holds tokens 0,1 and 14,15.
  const PackedCorpus packed(corpus_of({"abcdefghijklmnopq"}), 16);
  BatchSampler sampler(packed, 1, 0);
  const GlobalBatch batch = sampler.next();
  for (auto partition : {CpPartition::contiguous, CpPartition::head_tail}) {
    std::vector<at::Tensor> token_shards, label_shards;
    for (int64_t r = 0; r < 4; ++r) {
      const LocalBatch local = shard_batch(batch, partition, 4, r, 1, 0);
      EXPECT_EQ(local.document_ends, batch.document_ends) << "document ends stay global";
      EXPECT_EQ(local.global_label_count, 16);
      token_shards.push_back(local.tokens);
      label_shards.push_back(local.labels);
      // Each local label is the token after the local token in the global sequence.
      const std::vector<int64_t> tokens = to_vector(local.tokens), labels = to_vector(local.labels);
      for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(labels[i], tokens[i] + 1);
    }
    EXPECT_TRUE(at::equal(unshard_sequence(token_shards, partition), batch.tokens));
    EXPECT_TRUE(at::equal(unshard_sequence(label_shards, partition), batch.labels));
  }
  EXPECT_EQ(to_vector(shard_batch(batch, CpPartition::head_tail, 4, 0, 1, 0).labels),
            (std::vector<int64_t>{'b', 'c', 'p', 'q'}));  // 'q': the stream's next token, same document
}

TEST(PackedCorpus, RejectsACorpusTooSmallForOneSequence) {
  try {
    PackedCorpus(corpus_of({"tiny"}), 64);
    FAIL() << "expected mlacp::Error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("too small for one sequence"));
    EXPECT_THAT(e.what(), HasSubstr("corpus_tokens=4"));
    EXPECT_THAT(e.what(), HasSubstr("seq_len=64"));
  }
}

TEST(BatchSampler, OrderIsDeterministicAndResumesFromItsPosition) {
  const PackedCorpus packed(load_corpus(test::shipped_corpus()), 64);
  BatchSampler a(packed, 3, 11), b(packed, 3, 11), other_seed(packed, 3, 12);
  std::vector<GlobalBatch> first;
  for (int i = 0; i < 5; ++i) first.push_back(a.next());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(at::equal(b.next().tokens, first[i].tokens));
  EXPECT_FALSE(at::equal(other_seed.next().tokens, first[0].tokens));
  BatchSampler resumed(packed, 3, 11);
  resumed.set_position(3 * 3);
  EXPECT_TRUE(at::equal(resumed.next().tokens, first[3].tokens));
  EXPECT_EQ(resumed.position(), 12);
}

TEST(BatchSampler, EveryEpochVisitsEverySequenceOnce) {
  const PackedCorpus packed(corpus_of({std::string(40, 'x'), std::string(40, 'y')}), 8);  // 10 sequences
  BatchSampler sampler(packed, 5, 3);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<std::string> seen;
    for (int i = 0; i < 2; ++i) {
      const at::Tensor t = sampler.next().tokens;
      for (int64_t r = 0; r < t.size(0); ++r) {
        const std::vector<int64_t> row = to_vector(t[r]);
        seen.push_back(ByteTokenizer::decode(row));
      }
    }
    EXPECT_EQ(seen.size(), 10u);
    EXPECT_EQ(std::count(seen.begin(), seen.end(), std::string(8, 'x')), 5);
  }
}

}  // namespace
}  // namespace mlacp::train
