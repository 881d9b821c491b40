#include "mlacp/plan.h"

#include <algorithm>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/hash.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "CP plan";

void require_positive(int64_t value, const char* name) {
  MLACP_REQUIRE(value > 0, kWhat, std::string(name) + " must be > 0", {got(name, value)},
                "take the dims from the model's MlaConfig");
}

}  // namespace

std::string strategy_name(CpStrategy s) {
  return s == CpStrategy::expanded_ulysses ? "expanded_ulysses" : "latent_kv_head";
}

CpStrategy parse_strategy(const std::string& name) {
  if (name == "expanded_ulysses" || name == "expanded") return CpStrategy::expanded_ulysses;
  if (name == "latent_kv_head" || name == "latent") return CpStrategy::latent_kv_head;
  fail(kWhat, "strategy must be expanded_ulysses or latent_kv_head", {got("strategy", name)},
       "latent_kv_head moves the 576-wide latent; expanded_ulysses moves per-head K/V");
}

std::string partition_name(CpPartition p) { return p == CpPartition::contiguous ? "contiguous" : "head_tail"; }

CpPartition parse_partition(const std::string& name) {
  if (name == "contiguous") return CpPartition::contiguous;
  if (name == "head_tail" || name == "head-tail") return CpPartition::head_tail;
  fail(kWhat, "partition must be contiguous or head_tail", {got("partition", name)},
       "head_tail balances causal attention across ranks");
}

std::string kernel_name(AttentionKernel k) {
  switch (k) {
    case AttentionKernel::blockwise: return "blockwise";
    case AttentionKernel::reference: return "reference";
    case AttentionKernel::pieces: return "pieces";
  }
  return "?";
}

AttentionKernel parse_kernel(const std::string& name) {
  if (name == "blockwise") return AttentionKernel::blockwise;
  if (name == "reference" || name == "naive") return AttentionKernel::reference;  // "naive": the old spelling
  if (name == "pieces") return AttentionKernel::pieces;
  fail(kWhat, "attention kernel must be blockwise, reference or pieces", {got("kernel", name)},
       "blockwise never materialises S x S scores; reference (alias naive) is the oracle with S x S scores; "
       "pieces is the varlen-piece path of CUDA tensors (on the CPU a reference varlen kernel, for checking)");
}

CpPlan::CpPlan(const CpPlanSpec& spec) : spec_(spec) {
  const PlanDims& d = spec_.dims;
  require_positive(d.heads, "heads");
  require_positive(d.q_rank, "q_rank");
  require_positive(d.kv_rank, "kv_rank");
  require_positive(d.nope_dim, "nope_dim");
  require_positive(d.rope_dim, "rope_dim");
  require_positive(d.value_dim, "value_dim");
  MLACP_REQUIRE(d.rope_dim % 2 == 0, kWhat, "rope_dim must be even", {got("rope_dim", d.rope_dim)},
                "RoPE rotates lane pairs");
  MLACP_REQUIRE(spec_.tp >= 1, kWhat, "tp degree must be >= 1", {got("tp", spec_.tp)}, "use 1 for no TP");
  MLACP_REQUIRE(spec_.cp >= 1, kWhat, "cp degree must be >= 1", {got("cp", spec_.cp)}, "use 1 for no CP");
  if (spec_.ulysses == 0) spec_.ulysses = spec_.cp;
  MLACP_REQUIRE(spec_.ulysses >= 1, kWhat, "ulysses degree must be >= 1 (or 0 for U = P)",
                {got("ulysses", spec_.ulysses)}, "U = P is pure Ulysses, U = 1 pure all-gather");
  MLACP_REQUIRE(spec_.cp % spec_.ulysses == 0, kWhat, "cp degree must be divisible by the ulysses degree",
                {got("cp", spec_.cp), got("ulysses", spec_.ulysses)},
                "choose U dividing P (the A x U grid needs P = A*U)");
  MLACP_REQUIRE(d.heads % (spec_.tp * spec_.ulysses) == 0, kWhat, "heads must be divisible by tp * ulysses",
                {got("heads", d.heads), got("tp", spec_.tp), got("ulysses", spec_.ulysses)},
                "lower U (a hybrid layout all-gathers the rest) or change tp");
  MLACP_REQUIRE(!spec_.kv_recompute || (spec_.strategy == CpStrategy::latent_kv_head &&
                                        spec_.kernel == AttentionKernel::blockwise),
                kWhat, "kv_recompute needs the latent strategy and the blockwise kernel",
                {got("strategy", strategy_name(spec_.strategy)), got("kernel", kernel_name(spec_.kernel))},
                "use --strategy latent with the blockwise kernel, or turn kv_recompute off (the expanded strategy "
                "exchanges K/V and keeps them)");
}

int64_t CpPlan::kv_recompute_heads() const {
  const PlanDims& d = spec_.dims;
  return std::clamp<int64_t>((d.kv_rank + d.rope_dim) / (d.qk_dim() + d.value_dim), 1, head_block_size());
}

std::string CpPlan::to_text() const {
  const PlanDims& d = spec_.dims;
  std::ostringstream out;
  out << "CpPlan strategy=" << strategy_name(spec_.strategy) << " partition=" << partition_name(spec_.partition)
      << " overlap=" << (spec_.overlap ? "on" : "off") << " kernel=" << kernel_name(spec_.kernel)
      << (spec_.kv_recompute ? " kv_recompute=on" : "") << "\n"
      << "  degrees  tp=" << spec_.tp << " cp(P)=" << spec_.cp << " ulysses(U)=" << spec_.ulysses
      << " all_gather(A)=" << all_gather() << "\n"
      << "  dims     heads=" << d.heads << " Rq=" << d.q_rank << " Rkv=" << d.kv_rank << " Dn=" << d.nope_dim
      << " Dr=" << d.rope_dim << " Dv=" << d.value_dim << "\n"
      << "  heads    local(H)=" << local_heads() << " head block(Hc)=" << head_block_size()
      << "; CP rank r computes heads [u*Hc, (u+1)*Hc) with u = r % U\n";
  return out.str();
}

std::string CpPlan::to_json() const {
  const PlanDims& d = spec_.dims;
  nlohmann::ordered_json j;
  j["dims"] = {{"heads", d.heads}, {"q_rank", d.q_rank}, {"kv_rank", d.kv_rank},
               {"nope_dim", d.nope_dim}, {"rope_dim", d.rope_dim}, {"value_dim", d.value_dim}};
  j["tp"] = spec_.tp;
  j["cp"] = spec_.cp;
  j["ulysses"] = spec_.ulysses;
  j["all_gather"] = all_gather();
  j["strategy"] = strategy_name(spec_.strategy);
  j["overlap"] = spec_.overlap;
  j["partition"] = partition_name(spec_.partition);
  j["kernel"] = kernel_name(spec_.kernel);
  if (spec_.kv_recompute) j["kv_recompute"] = true;  // absent when off: earlier plans keep their fingerprint
  j["local_heads"] = local_heads();
  j["head_block_size"] = head_block_size();
  return j.dump();
}

uint64_t CpPlan::fingerprint() const {
  return fnv1a64(to_json());  // over the canonical JSON: stable across processes and builds
}

void check_shardable(CpPartition partition, int64_t seq_len, int64_t cp) {
  MLACP_REQUIRE(cp >= 1, kWhat, "cp degree must be >= 1", {got("cp", cp)}, "use 1 for no CP");
  const int64_t pieces = partition == CpPartition::contiguous ? cp : 2 * cp;
  MLACP_REQUIRE(seq_len > 0 && seq_len % pieces == 0, kWhat,
                "sequence length must be divisible by " +
                    std::string(partition == CpPartition::contiguous ? "P (contiguous)" : "2P (head_tail)"),
                {got("seq_len", seq_len), got("cp", cp), got("partition", partition_name(partition))},
                "pad the sequence to a multiple of " + std::to_string(pieces) + " tokens");
}

std::vector<int64_t> shard_token_indices(CpPartition partition, int64_t seq_len, int64_t cp, int64_t cp_rank) {
  check_shardable(partition, seq_len, cp);
  MLACP_REQUIRE(cp_rank >= 0 && cp_rank < cp, kWhat, "cp_rank must be in [0, cp)",
                {got("cp_rank", cp_rank), got("cp", cp)}, "pass this rank's position in the CP group");
  std::vector<int64_t> tokens;
  auto append = [&](int64_t begin, int64_t count) {
    for (int64_t t = begin; t < begin + count; ++t) tokens.push_back(t);
  };
  if (partition == CpPartition::contiguous) {
    const int64_t local = seq_len / cp;
    append(cp_rank * local, local);
  } else {
    const int64_t chunk = seq_len / (2 * cp);
    append(cp_rank * chunk, chunk);
    append((2 * cp - 1 - cp_rank) * chunk, chunk);
  }
  return tokens;
}

CommVolume expected_comm_elements(const CpPlan& plan, int64_t batch, int64_t seq_len) {
  const PlanDims& d = plan.dims();
  const int64_t p = plan.cp(), u = plan.ulysses(), a = plan.all_gather();
  const int64_t t = batch * seq_len / p;  // T: local tokens
  const int64_t h = plan.local_heads();
  CommVolume v;
  const int64_t out = t * h * d.value_dim * (u - 1) / u;
  v.forward_output = out;
  if (plan.strategy() == CpStrategy::expanded_ulysses) {
    const int64_t qkv = t * h * (2 * d.qk_dim() + d.value_dim) * (u - 1) / u;
    const int64_t kv_gather = (a - 1) * t * h * (d.qk_dim() + d.value_dim);
    v.forward_all_to_all = qkv;
    v.forward_all_gather = kv_gather;
    v.backward_all_to_all = out + qkv;
    v.backward_reduce = kv_gather;
  } else {
    const int64_t q = t * h * d.qk_dim() * (u - 1) / u;
    const int64_t gather = (p - 1) * t * (d.kv_rank + d.rope_dim);
    v.forward_all_to_all = q;
    v.forward_all_gather = gather;
    v.backward_all_to_all = out + q;
    v.backward_reduce = gather;
  }
  return v;
}

}  // namespace mlacp
