#include "core/host_allocator.h"

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

extern char** environ;

namespace mlacp {
namespace {

// A MALLOC_*_ variable (glibc's tunables of the same settings) set by the user.
const char* user_malloc_setting() {
  for (char** e = environ; e && *e; ++e) {
    const char* equals = std::strchr(*e, '=');
    if (std::strncmp(*e, "MALLOC_", 7) == 0 && equals && equals[-1] == '_') return *e;
  }
  return nullptr;
}

}  // namespace

HostAllocatorPolicy keep_freed_host_memory() {
  const char* choice = std::getenv("MLACP_HOST_ALLOCATOR");
  if (choice && std::strcmp(choice, "system") == 0) return {false, "MLACP_HOST_ALLOCATOR=system: glibc defaults kept"};
  if (const char* user = user_malloc_setting()) return {false, std::string("user setting kept: ") + user};
#if defined(__SANITIZE_ADDRESS__)
  return {false, "AddressSanitizer build: its allocator replaces glibc's and ignores mallopt"};
#elif defined(__GLIBC__)
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest allowed value
  constexpr int kTopPad = 64 << 20;
  const bool ok = mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 && mallopt(M_TRIM_THRESHOLD, -1) == 1 &&
                  mallopt(M_TOP_PAD, kTopPad) == 1 && mallopt(M_MMAP_MAX, 0) == 1;
  if (!ok) return {false, "mallopt refused a setting: glibc defaults kept"};
  return {true, "glibc: every block from the heap (no mmap), no trimming, 64 MiB top pad"};
#else
  return {false, "not glibc: the process's allocator is left as it is"};
#endif
}

}  // namespace mlacp
