// Devices without assumptions (docs/DESIGN.md §16): the device comes from the tensors; host
// metadata (token indices, document ends, piece plans) stays on the CPU and reaches a device
// without synchronising the host. Nothing here includes a CUDA header: the device-generic
// interfaces of c10 (DeviceGuardImplInterface, c10::Event) serve every backend LibTorch registered.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace mlacp {

// A host (CPU) tensor on `device`: itself on the CPU; elsewhere copied from pinned memory with
// non_blocking, so the host never waits for the device (a pageable copy would synchronise the
// stream). The pinned staging buffer is LibTorch's cached host allocator's; it stays alive until
// the copy is done. A tensor already on `device` is returned as it is.
at::Tensor host_to_device(const at::Tensor& host, const c10::Device& device);

// The device LibTorch calls current for a device type (e.g. the CUDA device set by
// torch.cuda.set_device / c10::cuda::set_device), through the device-generic guard interface.
// CPU -> cpu.
c10::Device current_device(c10::DeviceType type);

// Makes `device` current for the process (the tool's --device cuda ranks, before any tensor is
// made). A no-op for the CPU.
void set_current_device(const c10::Device& device);

// How many devices of a type this process sees (0 where LibTorch has no such backend, e.g. CUDA
// in a CPU-only LibTorch). CPU -> 1.
int64_t device_count(c10::DeviceType type);

// Blocks the host until every queued operation on the device's current stream is done (timing
// and reading results; never inside a step). A no-op for the CPU.
void synchronize_device(const c10::Device& device);

// A point on a device's current stream whose time can be read later (a timing-enabled c10::Event
// recorded where it is made). Reading blocks until the device has reached both points.
class DeviceTimePoint {
 public:
  explicit DeviceTimePoint(const c10::Device& device);  // records now on the current stream
  // Milliseconds from this point to `later` as the device executed them.
  double milliseconds_until(const DeviceTimePoint& later) const;

 private:
  std::shared_ptr<void> event_;  // c10::Event (kept opaque: c10/core/Event.h stays out of headers)
};

// Whether this LibTorch can time points on a device (timing events: LibTorch 2.x).
bool device_timing_available();

}  // namespace mlacp
