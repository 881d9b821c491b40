#include "core/device.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/compat.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "device";

const c10::impl::DeviceGuardImplInterface& guard_for(c10::DeviceType type) {
  MLACP_REQUIRE(c10::impl::hasDeviceGuardImpl(type), kWhat, "this LibTorch has no backend for the device type",
                {got("device_type", c10::DeviceTypeName(type))},
                "use a LibTorch built for the device (e.g. the CUDA wheel of PyTorch 2.x for cuda), or --device cpu");
  return *c10::impl::getDeviceGuardImpl(type);
}

}  // namespace

at::Tensor host_to_device(const at::Tensor& host, const c10::Device& device) {
  if (host.device() == device) return host;
  if (device.is_cpu() || !host.device().is_cpu()) return host.to(device);  // not a host -> device copy
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

c10::Device current_device(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU) return c10::Device(c10::DeviceType::CPU);
  return guard_for(type).getDevice();
}

void set_current_device(const c10::Device& device) {
  if (device.is_cpu()) return;
  guard_for(device.type()).setDevice(device);
}

int64_t device_count(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU) return 1;
  if (!c10::impl::hasDeviceGuardImpl(type)) return 0;
  return c10::impl::getDeviceGuardImpl(type)->deviceCount();
}

void synchronize_device(const c10::Device& device) {
  if (device.is_cpu()) return;
  guard_for(device.type()).getStream(device).synchronize();
}

bool device_timing_available() { return MLACP_TORCH_2 == 1; }

DeviceTimePoint::DeviceTimePoint(const c10::Device& device) {
#if MLACP_TORCH_2
  const c10::Stream stream = guard_for(device.type()).getStream(device);
  auto event = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);  // timing enabled
  event->record(stream);
  event_ = event;
#else
  fail(kWhat, "timing points on a device need LibTorch 2.x (c10::Event::elapsedTime)",
       {got("device", device), got("libtorch", TORCH_VERSION)}, "build against the PyTorch 2.x wheel's LibTorch");
#endif
}

double DeviceTimePoint::milliseconds_until(const DeviceTimePoint& later) const {
#if MLACP_TORCH_2
  const auto& from = *static_cast<const c10::Event*>(event_.get());
  const auto& to = *static_cast<const c10::Event*>(later.event_.get());
  from.synchronize();  // elapsedTime needs both events completed
  to.synchronize();
  return from.elapsedTime(to);
#else
  (void)later;
  return 0.0;
#endif
}

}  // namespace mlacp
