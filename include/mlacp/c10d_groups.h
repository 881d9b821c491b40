// Process groups that someone else built with c10d (torch.distributed in Python under torchrun,
// or a C++ trainer's own groups): mlacp uses them as they are, with no second rendezvous.
// The one public header that names c10d types; included by the Python binding.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "mlacp/comm.h"

namespace mlacp {

// A CommGroup over an existing c10d group: its backend for `device`'s type (the tensors' device:
// CPU, or this rank's GPU), its rank and size. A null group, or one of size 1, is a group of size 1
// that moves nothing.
CommGroup wrap_c10d_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const c10::Device& device,
                          const std::string& name, const Instruments& instruments);

// The groups parallelize() needs for a CP-only mesh (dp = tp = 1 as far as mlacp sees: the caller
// reduces gradients over its data-parallel groups itself) over existing groups: the CP group and,
// for a hybrid (1 < ulysses < cp), its Ulysses sub-group (U consecutive CP ranks) and all-gather
// sub-group ({u, u+U, ...}). For ulysses == cp or 1 the sub-groups are the CP group and a group of
// size 1 and may be null. Checks every size against the degrees before any collective.
ParallelGroups parallel_groups_from_c10d(const c10::intrusive_ptr<c10d::ProcessGroup>& cp, int64_t ulysses,
                                         const c10::intrusive_ptr<c10d::ProcessGroup>& ulysses_group,
                                         const c10::intrusive_ptr<c10d::ProcessGroup>& all_gather_group,
                                         const c10::Device& device);

}  // namespace mlacp
