#include "core/memory_probe.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "core/compat.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

class CountingAllocator final : public compat::AllocatorBase {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate_bytes(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, Record{static_cast<int64_t>(n), std::move(inner)});
    }
    const int64_t now = current_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    allocations_.fetch_add(1);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return c10::DataPtr(data, data, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  static CountingAllocator*& instance() {
    static CountingAllocator* probe = nullptr;
    return probe;
  }

  static void release(void* data) {
    CountingAllocator* self = instance();
    Record record;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->live_.find(data);
      if (it == self->live_.end()) return;  // cannot happen: only our DataPtrs carry this deleter
      record = std::move(it->second);
      self->live_.erase(it);
    }
    self->current_.fetch_sub(record.bytes);
    // record.inner goes out of scope here: the wrapped allocator's deleter frees the memory.
  }

  MemoryCounters counters() const { return {current_.load(), peak_.load(), allocations_.load()}; }
  void reset_peak() const { peak_.store(current_.load()); }

 private:
  struct Record {
    int64_t bytes = 0;
    c10::DataPtr inner;
  };
  c10::Allocator* inner_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Record> live_;
  mutable std::atomic<int64_t> current_{0};
  mutable std::atomic<int64_t> peak_{0};
  mutable std::atomic<int64_t> allocations_{0};
};

std::mutex& install_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

void install_memory_probe() {
  std::lock_guard<std::mutex> lock(install_mutex());
  CountingAllocator*& probe = CountingAllocator::instance();
  if (probe != nullptr && c10::GetCPUAllocator() == probe) return;
  if (probe == nullptr) probe = new CountingAllocator(c10::GetCPUAllocator());  // never deleted (see header)
  c10::SetCPUAllocator(probe, /*priority=*/0);
  MLACP_REQUIRE(c10::GetCPUAllocator() == probe, "memory probe",
                "the counting allocator could not replace the CPU allocator", {},
                "another allocator was installed with a higher priority");
}

bool memory_probe_installed() {
  CountingAllocator* probe = CountingAllocator::instance();
  return probe != nullptr && c10::GetCPUAllocator() == probe;
}

MemoryCounters memory_counters() {
  CountingAllocator* probe = CountingAllocator::instance();
  return probe ? probe->counters() : MemoryCounters{};
}

MemoryScope::MemoryScope() {
  install_memory_probe();
  CountingAllocator* probe = CountingAllocator::instance();
  probe->reset_peak();
  baseline_ = probe->counters().current_bytes;
}

int64_t MemoryScope::peak_extra_bytes() const { return memory_counters().peak_bytes - baseline_; }
int64_t MemoryScope::current_extra_bytes() const { return memory_counters().current_bytes - baseline_; }

}  // namespace mlacp
