// The output stage every schedule ends with (docs/DESIGN.md §5): the head->seq restore of the
// attention output (U > 1), the optional gate, and o_proj (row-parallel over TP: the partial
// outputs are summed over TP and the bias is added once after).
#pragma once

#include <ATen/core/Tensor.h>

#include "runtime/schedule.h"

namespace mlacp {

// attention [B, U*S_l, Hc, Dv] (this rank's Ulysses block rows, its head block); gate
// [B, S_l, H*Dv] when the schedule already computed it, else undefined (computed here when the
// config has a gate) -> [B, S_l, d].
//
// Plain form: each step differentiable, the restore's adjoint waited at once.
// Overlapped form (U > 1), one node:
//   forward:   restore (head->seq, waited) | [gate_proj] | o_proj
//   backward:  o_proj dgrad | launch dO | gate grad | o_proj wgrad | [gate_proj backward] | wait dO
at::Tensor output_stage(const ScheduleContext& ctx, const LocalStep& step, const at::Tensor& attention,
                        const at::Tensor& gate, bool overlap);

}  // namespace mlacp
