// Blockwise attention worker pool: runs workers on ATen's OpenMP pool via TensorIterator and
// falls back to serial execution in children forked after the pool was used.
#include "kernels/blockwise_workers.h"

#include <numeric>

#include <pthread.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>

namespace mlacp::blockwise_detail {
namespace {

// Work distribution. This library's translation units are compiled without -fopenmp, so the
// header-inlined at::parallel_for would run serially here; TensorIterator::for_each runs
// ATen's compiled parallel_for, i.e. the same OpenMP intra-op pool as ATen's own kernels.
//
// Fork safety: libgomp's pool does not survive fork(); a child forked after this process used
// the pool would hang in its next parallel region. A pthread_atfork handler marks such children
// and the kernel then runs serially in them (measured: without it the child hangs).
std::atomic<bool> g_pool_used{false};
std::atomic<bool> g_forked_after_pool{false};

void mark_forked_child() {
  if (g_pool_used.load()) g_forked_after_pool.store(true);
}

}  // namespace

int64_t worker_count() {
  if (g_forked_after_pool.load() || at::in_parallel_region()) return 1;
  return std::max(1, at::get_num_threads());
}

void run_workers(int64_t n_workers, const std::function<void(int64_t)>& worker) {
  if (n_workers <= 1) {
    worker(0);
    return;
  }
  static const bool fork_handler = pthread_atfork(nullptr, nullptr, &mark_forked_child) == 0;
  (void)fork_handler;
  g_pool_used.store(true);
  const at::Tensor ids = at::arange(n_workers, at::kLong);
  at::TensorIterator iter = at::TensorIteratorConfig().add_input(ids).build();
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
        for (int64_t o = 0; o < size1; ++o)
          for (int64_t i = 0; i < size0; ++i)
            worker(*reinterpret_cast<const int64_t*>(data[0] + i * strides[0] + o * strides[1]));
      },
      /*grain_size=*/1);
}

std::vector<int64_t> order_by_cost(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

}  // namespace mlacp::blockwise_detail
