// The host allocator's reuse policy for training processes. LibTorch's CPU tensors come from
// glibc malloc, which maps large blocks fresh and unmaps them on free (or trims the heap): every
// step then page-faults its activations in again. Measured in `mlacp bench` at its defaults
// (2 ranks, DeepSeek-V3 attention dims, S=512): ~9000 minor faults and ~20 ms of system time per
// step per rank, and the step-to-step noise that came with it.
#pragma once

#include <string>

namespace mlacp {

struct HostAllocatorPolicy {
  bool applied = false;
  std::string detail;  // what was set, or why nothing was
};

// Keeps freed host memory for reuse, the way a caching allocator does: every block comes from
// the heap (M_MMAP_MAX 0; a 32 MiB M_MMAP_THRESHOLD stays for programs that re-enable mmap),
// freed heap memory is not returned to the system (M_TRIM_THRESHOLD) and the heap grows in
// 64 MiB steps (M_TOP_PAD). The process keeps its peak footprint. glibc's mmap threshold cannot
// exceed 32 MiB, and from S = 8K the expanded K/V, the activations and their gradients are larger:
// they were mapped fresh every step (measured `mlacp bench --seq 8192 --strategy latent_kv_head`,
// 8 steps x 2 ranks: 1.98M minor faults with the threshold alone, 0.80M with no mmap). Does nothing when the user set glibc's own MALLOC_*_ variables, when
// MLACP_HOST_ALLOCATOR=system, or off glibc (an allocator such as jemalloc is then in charge).
HostAllocatorPolicy keep_freed_host_memory();

}  // namespace mlacp
