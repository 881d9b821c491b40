// Exact tensor-memory accounting for the CPU: a counting allocator that wraps LibTorch's CPU
// allocator (installed with c10::SetCPUAllocator) and tracks live and peak bytes of every tensor
// storage allocated while it is installed. Used by tests and benchmarks to state "peak extra
// memory of one call"; library code never depends on it.
//
// Contract:
//  - install_memory_probe() is idempotent and process-wide; the probe stays installed (the
//    allocator object is never destroyed, so storages it allocated can always be freed).
//  - Each DataPtr it hands out has ctx == data and a static deleter (raw_deleter() works); the
//    wrapped allocator's own DataPtr (with its original deleter and context) is kept and
//    destroyed when the storage is freed.
//  - Storage allocated before installation is not counted (nor subtracted when freed).
//  - Counters are atomic; MemoryScope resets the single process-wide peak, so use one scope at
//    a time (tests and benchmarks, not concurrent library code).
#pragma once

#include <cstdint>

namespace mlacp {

struct MemoryCounters {
  int64_t current_bytes = 0;  // live bytes allocated through the probe
  int64_t peak_bytes = 0;     // highest current_bytes since install or the last reset
  int64_t allocations = 0;    // allocations through the probe since install
};

void install_memory_probe();
bool memory_probe_installed();
MemoryCounters memory_counters();

// Installs the probe if needed and resets the peak to the current bytes.
//   MemoryScope scope;  run();  scope.peak_extra_bytes()  // highest (live − live at start)
class MemoryScope {
 public:
  MemoryScope();
  int64_t baseline_bytes() const { return baseline_; }
  int64_t peak_extra_bytes() const;     // peak − baseline
  int64_t current_extra_bytes() const;  // current − baseline

 private:
  int64_t baseline_ = 0;
};

}  // namespace mlacp
