// The host allocator policy: applied on glibc unless the user chose otherwise, and with it later
// training-like steps reuse their freed memory instead of page-faulting it in again.
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/host_allocator.h"

namespace mlacp {
namespace {

long minor_faults() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// One "step": a dozen activation-sized tensors (8 MiB and up, sizes differing) allocated and
// written, then all freed. Returns the minor page faults it took.
long faults_of_one_step() {
  const long before = minor_faults();
  {
    std::vector<at::Tensor> activations;
    for (int64_t i = 0; i < 12; ++i) activations.push_back(at::empty({(2 << 20) + i * 1024}, at::kFloat).fill_(1.0f));
  }
  return minor_faults() - before;
}

TEST(HostAllocator, UserChoicesAreKept) {
  setenv("MLACP_HOST_ALLOCATOR", "system", 1);
  HostAllocatorPolicy p = keep_freed_host_memory();
  EXPECT_FALSE(p.applied);
  EXPECT_NE(p.detail.find("MLACP_HOST_ALLOCATOR=system"), std::string::npos);
  unsetenv("MLACP_HOST_ALLOCATOR");
  setenv("MALLOC_TOP_PAD_", "1048576", 1);
  p = keep_freed_host_memory();
  EXPECT_FALSE(p.applied);
  EXPECT_NE(p.detail.find("MALLOC_TOP_PAD_"), std::string::npos);
  unsetenv("MALLOC_TOP_PAD_");
}

#if defined(__GLIBC__)
TEST(HostAllocator, LaterStepsReuseTheirMemoryWithoutPageFaults) {
  const HostAllocatorPolicy p = keep_freed_host_memory();
  if (!p.applied && std::getenv("MLACP_HOST_ALLOCATOR")) GTEST_SKIP() << p.detail;
  if (!p.applied && p.detail.rfind("user setting kept", 0) == 0) GTEST_SKIP() << p.detail;
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << p.detail;
#endif
  ASSERT_TRUE(p.applied) << p.detail;
  const long first = faults_of_one_step();  // ~24,600 pages touched for the first time
  for (int i = 0; i < 4; ++i) faults_of_one_step();  // the heap settles into its free blocks
  // The fewest faults of five later steps: the kernel may still fault a settled step's pages in
  // for its own reasons (e.g. compaction migrating them while other processes ask for huge
  // pages; a CI run failed on the largest of three later steps), never every step. glibc's
  // defaults unmap or trim part of the memory again at every step: ~8,000 faults each on this
  // host, so the fewest still shows a regression.
  long later = faults_of_one_step();
  for (int i = 0; i < 4; ++i) later = std::min(later, faults_of_one_step());
  EXPECT_LT(later, first / 20) << "first step " << first << " faults, the fewest of five later ones " << later;
}
#endif

}  // namespace
}  // namespace mlacp
