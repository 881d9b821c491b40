// Blockwise attention internals: the worker pool (ATen's intra-op pool, fork-safe) and dynamic
// task distribution over it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

namespace mlacp::blockwise_detail {

// Workers to use: 1 inside a parallel region or in a child forked after the pool ran.
int64_t worker_count();
// Runs worker(0) … worker(n_workers − 1) on the pool (inline when n_workers ≤ 1).
void run_workers(int64_t n_workers, const std::function<void(int64_t)>& worker);

// Pulls task indices from a shared counter (dynamic balance: causal rows differ in cost).
// `order` lists tasks most expensive first; setup(worker) returns that worker's state.
template <class State, class Setup, class Task, class Finish>
void run_tasks(const std::vector<int64_t>& order, Setup setup, Task task, Finish finish) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  run_workers(std::min<int64_t>(worker_count(), std::max<int64_t>(n, 1)), [&](int64_t worker) {
    State state = setup(worker);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) task(order[t], state);
    finish(state);
  });
}

// Task indices, most expensive first (stable).
std::vector<int64_t> order_by_cost(const std::vector<int64_t>& cost);

}  // namespace mlacp::blockwise_detail
