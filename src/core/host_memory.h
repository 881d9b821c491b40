// How much host memory a run may still use: MemAvailable of /proc/meminfo, lowered to the room
// left under a cgroup (v2 memory.max - memory.current, or v1 limit - usage) when one limits this
// process. Read once per call; used by the tool's memory check (include/mlacp/memory.h).
#pragma once

#include <string>

namespace mlacp {

struct HostMemory {
  double available_bytes = 0;  // 0 when nothing could be read
  std::string source;          // "MemAvailable", "cgroup memory.max"
};

HostMemory available_host_memory();

}  // namespace mlacp
