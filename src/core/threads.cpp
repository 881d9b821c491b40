#include "core/threads.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sched.h>

#include <atomic>
#include <cstdlib>

#include <ATen/Parallel.h>

namespace mlacp {
namespace {
using SetThreads = void (*)(int);
// Looked up at run time: the BLAS is whatever libblas.so.3 resolves to on this host.
SetThreads openblas_setter() {
  static const SetThreads setter =
      reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  return setter;
}
std::atomic<int> g_intra_op_threads{0};
}  // namespace

int intra_op_threads() { return g_intra_op_threads.load(std::memory_order_relaxed); }

bool blas_threads_settable() { return openblas_setter() != nullptr; }

bool use_batch_scheduling() {
#if defined(__linux__)
  sched_param param{};
  param.sched_priority = 0;
  if (sched_setscheduler(0, SCHED_BATCH, &param) != 0) return false;  // this thread and its future ones
  if (DIR* tasks = opendir("/proc/self/task")) {  // threads already started (pools, stores)
    while (dirent* entry = readdir(tasks))
      if (entry->d_name[0] != '.') sched_setscheduler(std::atoi(entry->d_name), SCHED_BATCH, &param);
    closedir(tasks);
  }
  return true;
#else
  return false;
#endif
}

void set_intra_op_threads(int threads) {
  at::set_num_threads(threads);
  g_intra_op_threads.store(threads, std::memory_order_relaxed);
  if (SetThreads setter = openblas_setter()) setter(threads);
}

}  // namespace mlacp
