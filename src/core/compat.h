// The one place where LibTorch version differences live (1.13 from Debian vs 2.x from a wheel).
// Everything else calls these helpers.
#pragma once

#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/macros/Export.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

namespace mlacp::compat {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define MLACP_TORCH_DEVICE_AUTOCAST 1
#else
#define MLACP_TORCH_DEVICE_AUTOCAST 0
#endif
#if TORCH_VERSION_MAJOR >= 2
#define MLACP_TORCH_2 1
#else
#define MLACP_TORCH_2 0
#endif

// c10::Allocator: 2.x made allocate() non-const and copy_data() pure virtual. Derive from this
// and implement allocate_bytes().
class AllocatorBase : public c10::Allocator {
 public:
  virtual c10::DataPtr allocate_bytes(size_t n) = 0;
#if MLACP_TORCH_2
  c10::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return const_cast<AllocatorBase*>(this)->allocate_bytes(n); }
#endif
};

// A hand-written autograd node, owned as the LibTorch at hand owns its own: up to 2.11 (1.13 too)
// nodes live in std::shared_ptr and long graphs are deleted iteratively through
// torch::autograd::deleteNode; later 2.x nodes are intrusive (c10::intrusive_ptr, Node derives from
// c10::intrusive_ptr_target). Decided by the node type itself, not by a version number (the change
// came between 2.11 and 2.15). Both convert to what set_history() takes.
}  // namespace mlacp::compat
namespace torch::autograd {
struct Node;
TORCH_API void deleteNode(Node* function);  // used only where nodes are shared_ptr-owned
}  // namespace torch::autograd
namespace mlacp::compat {
template <typename NodeT, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, NodeT>) {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  } else {
    return std::shared_ptr<NodeT>(new NodeT(std::forward<Args>(args)...), torch::autograd::deleteNode);
  }
}

inline bool autocast_enabled(c10::DeviceType device) {
#if MLACP_TORCH_DEVICE_AUTOCAST
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if MLACP_TORCH_DEVICE_AUTOCAST
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast(c10::DeviceType device, bool enabled, c10::ScalarType dtype) {
#if MLACP_TORCH_DEVICE_AUTOCAST
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

// Enters (or leaves) autocast for one device for the guard's lifetime; restores the previous
// state and clears the autocast weight cache on exit. Used by tests, the tools, and backward
// nodes that re-enter the forward's autocast state.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, bool enabled, c10::ScalarType dtype)
      : device_(device), was_enabled_(autocast_enabled(device)), was_dtype_(autocast_dtype(device)) {
    set_autocast(device, enabled, dtype);
  }
  ~AutocastGuard() {
    set_autocast(device_, was_enabled_, was_dtype_);
    if (!was_enabled_) at::autocast::clear_cache();
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  c10::ScalarType was_dtype_;
};

// The autocast state of a forward, captured when it runs and re-entered by backward code that
// computes GEMMs itself (a backward runs outside the forward's autocast region). The one capture
// used by schedules and kernels.
struct AutocastSnapshot {
  c10::DeviceType device = c10::DeviceType::CPU;
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;
  // `device`: the device type of the tensors the forward ran on (autocast is per device type).
  static AutocastSnapshot capture(c10::DeviceType device) {
    return {device, autocast_enabled(device), autocast_dtype(device)};
  }
  // Re-enters the captured state for the guard's lifetime (null when autocast was off).
  std::unique_ptr<AutocastGuard> enter() const {
    return enabled ? std::make_unique<AutocastGuard>(device, true, dtype) : nullptr;
  }
};

}  // namespace mlacp::compat
