// Multi-rank verification (docs/DESIGN.md §9): a CP case run on real ranks against the single-device
// reference. Every rank computes the float64 reference itself (the cases are small), runs its
// shard through the installed runtime, reduces gradients (docs/DESIGN.md §7) and compares its own slices;
// errors are max-reduced over the world so every rank reports the same rows.
#pragma once

#include <string>
#include <vector>

#include "check/cases.h"
#include "check/single_device_checks.h"
#include "mlacp/comm.h"
#include "mlacp/memory.h"
#include "mlacp/plan.h"

namespace mlacp {

struct CpCase {
  std::string name;
  VerifyCase base;  // config, batch, seq_len, causal, documents, band mask, seed
  MeshShape mesh;   // dp x cp x tp (ulysses 0 = cp)
  CpStrategy strategy = CpStrategy::latent_kv_head;
  CpPartition partition = CpPartition::contiguous;
  bool overlap = false;
  at::ScalarType dtype = at::kDouble;  // kBFloat16: float32 parameters under bf16 autocast
  std::vector<std::string> frozen;     // parameter-name prefixes frozen; "hidden" freezes the input
  AttentionKernel kernel = AttentionKernel::blockwise;        // the CP runtime's local kernel
  bool kv_recompute = false;                                  // CpPlanSpec::kv_recompute (latent strategy)
  AttentionKernel reference_kernel = AttentionKernel::reference;  // the single-device oracle's
  bool reference_on_rank0 = false;  // long sequences: rank 0 alone computes the reference and shares it
  std::string describe() const;        // one line with every parameter
};

// Tolerances (docs/DESIGN.md §9).
constexpr double kCpFloat64Tolerance = 1e-10;  // max abs error
constexpr double kCpFloat32Tolerance = 1e-5;   // max error relative to max |reference|
constexpr double kCpBf16Factor = 2.0;          // bf16: at most 2x the single-device bf16 error
constexpr double kOverlapTolerance = 0.0;  // overlap on vs off, every dtype: identical to the bit

// Checks that need no collective (run on every rank before the first one).
void validate_cp_case(const CpCase& c, int64_t world_size);

// Peak bytes one rank holds while running the case (the CP run, the single-device oracle it is
// compared with, their results), from shapes alone: checked against the host before any rank
// starts (include/mlacp/memory.h). cp_run_on_device: the CP run's tensors live on a GPU; the host
// holds the oracle and the results.
MemoryEstimate cp_case_memory(const CpCase& c, bool cp_run_on_device = false);

// Runs the case on this rank's groups, whose shape must be c.mesh (see GroupCache).
std::vector<CheckRow> run_cp_case(const CpCase& c, ParallelGroups& groups);

// Builds each mesh shape's groups once and hands them out again for later cases of that shape
// (fewer rendezvous: faster, and a peer that dies mid-run is met inside a collective, where the
// timeout applies). Every rank must ask for the same shapes in the same order.
class GroupCache {
 public:
  GroupCache(Rendezvous rendezvous, GroupOptions options)
      : rendezvous_(std::move(rendezvous)), options_(std::move(options)) {}
  ParallelGroups& get(const MeshShape& shape);

 private:
  Rendezvous rendezvous_;
  GroupOptions options_;
  std::vector<std::pair<MeshShape, ParallelGroups>> built_;
};

// The quick matrix `mlacp verify` runs by default on `world_size` ranks.
std::vector<CpCase> default_cp_cases(int64_t world_size);
// The full float64 exactness matrix of the test suite (P = 4).
std::vector<CpCase> exactness_cp_cases();
// The same structures through the varlen pieces (AttentionKernel::pieces: the path CUDA tensors
// take, on the CPU through the reference varlen kernel; docs/DESIGN.md §16), named "<case>-via-pieces";
// the cases that already name their kernel are left out.
std::vector<CpCase> pieces_cp_cases();
std::vector<CpCase> find_cp_cases(const std::vector<std::string>& names, int64_t world_size);

}  // namespace mlacp
