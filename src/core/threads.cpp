#include "core/threads.h"

#include <dlfcn.h>

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
}  // namespace

bool blas_threads_settable() { return openblas_setter() != nullptr; }

void set_intra_op_threads(int threads) {
  at::set_num_threads(threads);
  if (SetThreads setter = openblas_setter()) setter(threads);
}

}  // namespace mlacp
