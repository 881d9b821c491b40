// Named CP cases: the quick default matrix of `mlacp verify` and the exactness matrix of the
// test suite. One description names a test, a verify row and (later) a benchmark row.
#include <ATen/ATen.h>

#include "check/cp_checks.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

std::string short_name(CpStrategy s) { return s == CpStrategy::expanded_ulysses ? "expanded" : "latent"; }

CpCase make(const std::string& name, CpStrategy strategy, int64_t cp, int64_t ulysses, CpPartition partition,
            bool causal, int64_t seq_len = 32) {
  CpCase c;
  c.name = name;
  c.base = VerifyCase{name, preset_config("tiny")};
  c.base.seq_len = seq_len;
  c.base.causal = causal;
  c.mesh = {1, cp, 1, ulysses};
  c.strategy = strategy;
  c.partition = partition;
  c.overlap = true;  // every case also checks overlap on == overlap off (docs/DESIGN.md §5)
  return c;
}

CpCase with_docs(CpCase c) {
  c.name += "-packed";
  c.base.batch = 1;
  c.base.seq_len = 256;
  c.base.document_ends = {3, 73, 129, 256};
  return c;
}

// The latent strategy with K/V recomputed per head sub-block (runtime/latent_kv_attention.h).
CpCase kv_recomputed(CpCase c) {
  c.name += "-kv-recompute";
  c.kv_recompute = true;
  return c;
}

}  // namespace

std::vector<CpCase> exactness_cp_cases() {
  std::vector<CpCase> cases;
  for (CpStrategy s : {CpStrategy::expanded_ulysses, CpStrategy::latent_kv_head})
    for (int64_t u : {1, 2, 4})
      for (CpPartition p : {CpPartition::contiguous, CpPartition::head_tail})
        for (bool causal : {true, false})
          cases.push_back(make(short_name(s) + "-u" + std::to_string(u) + "-" + partition_name(p) +
                                   (causal ? "-causal" : "-full"),
                               s, 4, u, p, causal));
  for (CpStrategy s : {CpStrategy::expanded_ulysses, CpStrategy::latent_kv_head}) {
    const std::string n = short_name(s);
    {
      CpCase c = make(n + "-tp2-cp2-gate", s, 2, 2, CpPartition::head_tail, true);
      c.mesh.tp = 2;
      c.base.config.output_gate = true;
      cases.push_back(c);
    }
    {
      CpCase c = make(n + "-tp2-cp2-bias", s, 2, 2, CpPartition::contiguous, true);
      c.mesh.tp = 2;
      c.base.config.attention_bias = true;
      c.base.config.up_proj_bias = true;
      cases.push_back(c);
    }
    for (CpPartition p : {CpPartition::contiguous, CpPartition::head_tail})
      cases.push_back(with_docs(make(n + "-u2-" + partition_name(p), s, 4, 2, p, true)));
    {
      CpCase c = make(n + "-u2-band-masked-row", s, 4, 2, CpPartition::contiguous, false);
      c.base.band_width = 5;
      c.base.masked_rows = {9, 30};
      cases.push_back(c);
    }
    {
      CpCase c = make(n + "-u4-gate", s, 4, 4, CpPartition::head_tail, true);
      c.base.config.output_gate = true;
      cases.push_back(c);
    }
    {
      CpCase c = make(n + "-u2-frozen-down", s, 4, 2, CpPartition::contiguous, true);
      c.frozen = {"q_a_proj", "kv_b_proj"};
      cases.push_back(c);
    }
    {
      CpCase c = make(n + "-u1-frozen-input-out", s, 4, 1, CpPartition::head_tail, true);
      c.frozen = {"hidden", "o_proj"};
      cases.push_back(c);
    }
    {
      CpCase c = make(n + "-dp2-cp2", s, 2, 2, CpPartition::contiguous, true);
      c.mesh.dp = 2;
      cases.push_back(c);
    }
    {
      // The naive kernel in the CP runtime: the schedules' single-call attention path (the
      // blockwise kernel's latent path splits rows, see own_rows_attention).
      CpCase c = make(n + "-u2-reference-kernel", s, 4, 2, CpPartition::head_tail, true);
      c.kernel = AttentionKernel::reference;
      cases.push_back(c);
    }
    {
      // The varlen-piece path of CUDA tensors, run on the CPU through the reference varlen kernel:
      // documents crossing head_tail shards (segments x documents, bottom-right causal), and a
      // mask with rows that see no key (the dense masked path).
      CpCase c = with_docs(make(n + "-u2-head_tail-pieces", s, 4, 2, CpPartition::head_tail, true));
      c.kernel = AttentionKernel::pieces;
      cases.push_back(c);
      CpCase m = make(n + "-u2-band-masked-row-pieces", s, 4, 2, CpPartition::contiguous, false);
      m.base.band_width = 5;
      m.base.masked_rows = {9, 30};
      m.kernel = AttentionKernel::pieces;
      cases.push_back(m);
    }
    {
      CpCase c = make(n + "-u2-bf16", s, 4, 2, CpPartition::head_tail, true, 64);
      c.dtype = at::kBFloat16;
      cases.push_back(c);
    }
    {
      CpCase c = make(n + "-u2-float32-noqlatent-bias", s, 4, 2, CpPartition::contiguous, true);
      c.dtype = at::kFloat;
      c.base.config.q_lora_rank = std::nullopt;
      c.base.config.attention_bias = true;
      c.base.config.up_proj_bias = true;
      c.base.config.rope_layout = RopeLayout::interleaved;
      cases.push_back(c);
    }
  }
  // K/V recompute: every kind of input it handles differently (sub-blocks of one head and of two
  // with a remainder, biases, frozen kv_b_proj or input, bf16 autocast, documents, empty rows).
  const CpStrategy latent = CpStrategy::latent_kv_head;
  cases.push_back(kv_recomputed(make("latent-u1-head_tail-causal", latent, 4, 1, CpPartition::head_tail, true)));
  cases.push_back(kv_recomputed(make("latent-u4-contiguous-full", latent, 4, 4, CpPartition::contiguous, false)));
  cases.push_back(kv_recomputed(with_docs(make("latent-u2-head_tail", latent, 4, 2, CpPartition::head_tail, true))));
  {
    CpCase c = make("latent-u2-six-heads-two-per-block", latent, 4, 2, CpPartition::head_tail, true);
    c.base.config.num_heads = 6;      // Hc = 3: sub-blocks of 2 and 1 heads
    c.base.config.kv_lora_rank = 16;  // (Rkv + Dr) / (Dqk + Dv) = 18 / 9 = 2 heads a sub-block
    cases.push_back(kv_recomputed(c));
  }
  {
    CpCase c = make("latent-u2-band-masked-row", latent, 4, 2, CpPartition::contiguous, false);
    c.base.band_width = 5;
    c.base.masked_rows = {9, 30};
    cases.push_back(kv_recomputed(c));
  }
  {
    CpCase c = make("latent-tp2-cp2-bias", latent, 2, 2, CpPartition::contiguous, true);
    c.mesh.tp = 2;
    c.base.config.attention_bias = true;
    c.base.config.up_proj_bias = true;
    cases.push_back(kv_recomputed(c));
  }
  {
    CpCase c = make("latent-u2-frozen-down", latent, 4, 2, CpPartition::contiguous, true);
    c.frozen = {"q_a_proj", "kv_b_proj"};
    cases.push_back(kv_recomputed(c));
  }
  {
    CpCase c = make("latent-u1-frozen-input-out", latent, 4, 1, CpPartition::head_tail, true);
    c.frozen = {"hidden", "o_proj"};
    cases.push_back(kv_recomputed(c));
  }
  {
    CpCase c = make("latent-u2-bf16", latent, 4, 2, CpPartition::head_tail, true, 64);
    c.dtype = at::kBFloat16;
    cases.push_back(kv_recomputed(c));
  }
  {
    CpCase c = make("latent-u2-float32-noqlatent-bias", latent, 4, 2, CpPartition::contiguous, true);
    c.dtype = at::kFloat;
    c.base.config.q_lora_rank = std::nullopt;
    c.base.config.attention_bias = true;
    c.base.config.up_proj_bias = true;
    cases.push_back(kv_recomputed(c));
  }
  return cases;
}

std::vector<CpCase> default_cp_cases(int64_t world_size) {
  if (world_size == 4) {
    return find_cp_cases({"latent-u4-contiguous-causal", "expanded-u4-head_tail-causal", "latent-u2-head_tail-full",
                          "expanded-u1-contiguous-causal", "latent-u2-head_tail-packed", "expanded-u2-band-masked-row",
                          "latent-tp2-cp2-gate", "expanded-dp2-cp2", "latent-u2-frozen-down", "latent-u2-bf16"},
                         4);
  }
  // Any other world: pure CP over every rank, each strategy, one hybrid where U can divide.
  std::vector<CpCase> cases;
  const int64_t p = world_size;
  for (CpStrategy s : {CpStrategy::expanded_ulysses, CpStrategy::latent_kv_head}) {
    std::vector<int64_t> degrees{p};
    if (p / 2 > 1 && p % (p / 2) == 0) degrees.push_back(p / 2);
    if (p > 1) degrees.push_back(1);
    for (int64_t u : degrees) {
      CpCase c = make(short_name(s) + "-p" + std::to_string(p) + "-u" + std::to_string(u) + "-head_tail", s, p, u,
                      CpPartition::head_tail, true, 4 * p);
      c.base.config.num_heads = std::max<int64_t>(4, p);
      cases.push_back(c);
    }
  }
  return cases;
}

std::vector<CpCase> pieces_cp_cases() {
  std::vector<CpCase> cases;
  for (CpCase c : exactness_cp_cases()) {
    if (c.kernel != AttentionKernel::blockwise || c.kv_recompute) continue;  // kv_recompute: CPU blockwise only
    c.kernel = AttentionKernel::pieces;
    c.name += "-via-pieces";
    cases.push_back(c);
  }
  return cases;
}

std::vector<CpCase> find_cp_cases(const std::vector<std::string>& names, int64_t world_size) {
  std::vector<CpCase> known = exactness_cp_cases();
  if (names.size() == 1 && names[0] == "all") return world_size == 4 ? known : default_cp_cases(world_size);
  if (names.size() == 1 && names[0] == "pieces") {
    MLACP_REQUIRE(world_size == 4, "verify", "the pieces matrix runs on 4 ranks (its cases have P = 4)",
                  {got("ranks", world_size)}, "pass --nproc 4");
    return pieces_cp_cases();
  }
  const std::vector<CpCase> pieces = pieces_cp_cases();
  known.insert(known.end(), pieces.begin(), pieces.end());
  if (world_size != 4) {
    const auto extra = default_cp_cases(world_size);
    known.insert(known.end(), extra.begin(), extra.end());
  }
  std::vector<CpCase> found;
  for (const auto& name : names) {
    bool hit = false;
    for (const auto& c : known)
      if (c.name == name) {
        found.push_back(c);
        hit = true;
        break;
      }
    MLACP_REQUIRE(hit, "verify", "unknown CP case name", {got("case", name)},
                  "list the names with `mlacp verify --list`");
  }
  return found;
}

}  // namespace mlacp
