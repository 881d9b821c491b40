// CpPlan: how one MLA layer runs across ranks (docs/DESIGN.md §3). Immutable, validated at construction,
// identical on every rank (a fingerprint is compared when CP is installed), printable as text
// and JSON. Pure C++: no tensors, no communication.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlacp {

enum class CpStrategy { expanded_ulysses, latent_kv_head };
// The local attention kernel: blockwise (flash-style, no S x S scores; the default), the naive
// reference (materialised scores; the oracle, kept for checking), or pieces (the structure cut into
// varlen pieces for a varlen kernel: the path CUDA tensors take, docs/DESIGN.md §16; on CPU tensors
// it runs a reference varlen kernel, to check the planning). blockwise on CUDA tensors runs pieces.
enum class AttentionKernel { blockwise, reference, pieces };
enum class CpPartition { contiguous, head_tail };

std::string strategy_name(CpStrategy strategy);
CpStrategy parse_strategy(const std::string& name);
std::string partition_name(CpPartition partition);
std::string kernel_name(AttentionKernel kernel);
AttentionKernel parse_kernel(const std::string& name);
CpPartition parse_partition(const std::string& name);

// MLA dimensions the plan needs (from MlaConfig; see its glossary).
struct PlanDims {
  int64_t heads = 0;         // global heads
  int64_t q_rank = 0;        // Rq (or hidden size without a q latent)
  int64_t kv_rank = 0;       // Rkv
  int64_t nope_dim = 0;      // Dn
  int64_t rope_dim = 0;      // Dr
  int64_t value_dim = 0;     // Dv
  int64_t qk_dim() const { return nope_dim + rope_dim; }
};

struct CpPlanSpec {
  PlanDims dims;
  int64_t tp = 1;
  int64_t cp = 1;        // P
  int64_t ulysses = 0;   // U; 0 = P (pure Ulysses)
  CpStrategy strategy = CpStrategy::latent_kv_head;
  bool overlap = false;
  CpPartition partition = CpPartition::contiguous;
  AttentionKernel kernel = AttentionKernel::blockwise;
  // Latent strategy, blockwise kernel: K/V of the head block expanded from the gathered latent a
  // few heads at a time in the forward and again in the backward, never kept for it (docs/DESIGN.md
  // §5, "K/V recompute"). Less memory per rank, one more kv_b_proj pass; the same values.
  bool kv_recompute = false;
};

class CpPlan {
 public:
  // Validates every rule of docs/DESIGN.md §3; throws mlacp::Error naming the first broken one.
  explicit CpPlan(const CpPlanSpec& spec);

  const PlanDims& dims() const { return spec_.dims; }
  int64_t tp() const { return spec_.tp; }
  int64_t cp() const { return spec_.cp; }
  int64_t ulysses() const { return spec_.ulysses; }           // U
  int64_t all_gather() const { return spec_.cp / spec_.ulysses; }  // A = P / U
  CpStrategy strategy() const { return spec_.strategy; }
  bool overlap() const { return spec_.overlap; }
  CpPartition partition() const { return spec_.partition; }
  AttentionKernel kernel() const { return spec_.kernel; }
  bool kv_recompute() const { return spec_.kv_recompute; }
  // Heads kv_recompute expands at a time: a sub-block's K/V no wider than the latent (Rkv + Dr
  // values a token), at least one head, at most the head block.
  int64_t kv_recompute_heads() const;
  int64_t local_heads() const { return spec_.dims.heads / spec_.tp; }          // H
  int64_t head_block_size() const { return local_heads() / spec_.ulysses; }      // Hc = H / U
  // Grid position of a CP rank: Ulysses rank u = r % U, all-gather index a = r / U.
  int64_t ulysses_rank(int64_t cp_rank) const { return cp_rank % spec_.ulysses; }
  int64_t all_gather_rank(int64_t cp_rank) const { return cp_rank / spec_.ulysses; }
  int64_t head_begin(int64_t cp_rank) const { return ulysses_rank(cp_rank) * head_block_size(); }

  std::string to_text() const;
  std::string to_json() const;
  // Stable 64-bit hash of the canonical JSON; equal plans have equal fingerprints.
  uint64_t fingerprint() const;
  const CpPlanSpec& spec() const { return spec_; }

 private:
  CpPlanSpec spec_;
};

// Global token indices held by CP rank `cp_rank` (docs/DESIGN.md §2):
//   contiguous: [r*S_l, (r+1)*S_l)
//   head_tail:  chunks r and 2P-1-r of 2P equal chunks
// Throws when seq_len is not divisible as the partition requires.
std::vector<int64_t> shard_token_indices(CpPartition partition, int64_t seq_len, int64_t cp, int64_t cp_rank);
// Checks seq_len divisibility for the partition (P for contiguous, 2P for head_tail).
void check_shardable(CpPartition partition, int64_t seq_len, int64_t cp);

// Elements each rank sends per layer by collective kind (docs/DESIGN.md §4), for a batch of B sequences of
// S tokens. "in" = forward input exchanges (all-to-all), "gather", "out" = output restore, and
// the backward mirror (reduce_scatter for the latent gather's gradient).
struct CommVolume {
  int64_t forward_all_to_all = 0;   // Q/K/V (expanded) or Q (latent) seq->head
  int64_t forward_all_gather = 0;   // K/V (expanded, A > 1) or latent payload (latent)
  int64_t forward_output = 0;       // O head->seq
  int64_t backward_all_to_all = 0;  // dO seq->head + dQ/dK/dV head->seq
  int64_t backward_reduce = 0;      // reduce-scatter of gathered gradients
};
CommVolume expected_comm_elements(const CpPlan& plan, int64_t batch, int64_t seq_len);

}  // namespace mlacp
