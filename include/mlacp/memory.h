// Memory estimates: how many bytes of host (or device) memory one rank's run will hold at its
// peak, computed from shapes alone before anything is allocated (docs/DESIGN.md §8, "Memory
// estimate"). Pure C++: no tensors, no machine queries (the caller brings the limit).
//
// The estimate is an upper bound of the tensor storage a run allocates (what LibTorch's
// allocator hands out), not of the process's resident size: the tests hold it between the
// measured peak and a small multiple of it for every command's typical shapes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mlacp/plan.h"

namespace mlacp {

struct MemoryEstimate {
  std::vector<std::pair<std::string, double>> parts;  // name -> bytes
  double total() const;
  void add(const std::string& name, double bytes);
  void add(const MemoryEstimate& other, double times = 1.0, const std::string& prefix = "");
  // "1.23 GiB (parameters 0.10 GiB, activations 1.00 GiB, ...)": the largest parts first.
  std::string to_text() const;
};

// One MLA layer's shapes on one rank, beyond its CpPlan.
struct LayerShape {
  int64_t batch = 1;         // sequences on this rank (after DP)
  int64_t seq_len = 0;       // global S (every CP rank holds S / P of it)
  int64_t hidden = 0;        // d
  bool q_latent = true;      // false: q_proj from the hidden state (dims.q_rank is then d)
  bool output_gate = false;  // o_gate_proj
  int64_t element_bytes = 4;  // of the parameters, their gradients, the module's input and output (bf16 autocast: 4)
  int64_t activation_bytes = 0;  // of the projections' other activations (bf16 autocast: 2, the width of
                                 // the GEMMs' outputs and of their inputs' cast copies); 0: element_bytes
  int64_t attention_bytes = 0;  // of what attention exchanges and its kernel's buffers (bf16 autocast: 2, the
                                // width they cross the wire and are computed in); 0: element_bytes
  bool backward = true;       // forward + backward (gradients, saved activations); false: forward only
  int64_t threads = 1;        // intra-op threads of a rank: with more threads than a kernel call has heads,
                              // the blockwise backward sums dK/dV through per-group partials
};

// Elements of one layer's parameters on a rank (TP-local heads; biases and norms ignored: < 1%).
double layer_parameter_elements(const CpPlan& plan, const LayerShape& shape);

// Peak bytes of one rank's forward (+ backward) of one CP layer: its parameters (and their
// gradients), the activations saved for the backward, the exchanged K/V or latent, and the local
// kernel's working set (the reference kernel materialises its S_q x S_k scores several times).
MemoryEstimate layer_memory(const CpPlan& plan, const LayerShape& shape);

// The bytes a run may plan to use on one host, and the check against them.
struct MemoryLimit {
  double bytes = 0;       // the limit for the whole host (all local ranks together)
  std::string source;     // "90% of available memory (MemAvailable)", "--memory-limit 12 GiB"
  bool enforced = true;   // false: --memory-limit off (the estimate is not checked)
};

// Throws an mlacp::Error (input) when `ranks_on_host` ranks of `per_rank` bytes exceed the
// limit, naming the estimate, its largest parts, the limit and both ways out.
void check_memory(const std::string& what, const MemoryEstimate& per_rank, int64_t ranks_on_host,
                  const MemoryLimit& limit);

// "1.5 GiB", "312 MiB", "4.0 KiB": for messages.
std::string format_bytes(double bytes);

}  // namespace mlacp
