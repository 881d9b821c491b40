// The device helpers and the timeline's clocks (docs/DESIGN.md §16), on a machine without a GPU:
// the CPU cases, and what a CUDA request says where this LibTorch or machine cannot serve it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/compat.h"
#include "core/device.h"
#include "core/timeline.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

TEST(Device, HostTensorsStayWhereTheyAreForTheCpu) {
  const at::Tensor host = at::arange(5, at::kLong);
  EXPECT_TRUE(host_to_device(host, c10::Device(c10::DeviceType::CPU)).is_same(host));
  EXPECT_EQ(current_device(c10::DeviceType::CPU), c10::Device(c10::DeviceType::CPU));
  EXPECT_EQ(device_count(c10::DeviceType::CPU), 1);
  set_current_device(c10::Device(c10::DeviceType::CPU));   // a no-op
  synchronize_device(c10::Device(c10::DeviceType::CPU));   // a no-op
}

TEST(Device, NoVisibleGpuCountsZeroAndAsksForNone) {
  // This machine has no GPU (CI neither): CUDA counts 0, whatever the LibTorch.
  EXPECT_EQ(device_count(c10::DeviceType::CUDA), 0);
  EXPECT_EQ(device_timing_available(), MLACP_TORCH_2 == 1);
}

TEST(Timeline, HostClockOnTheCpuAndDeviceEventsOnlyWhereLibTorchTimesThem) {
  Timeline timeline;
  EXPECT_FALSE(timeline.device_timed());
  timeline.set_enabled(true);
  {
    ComputeSpan span(&timeline, "work");
  }
  const TimePoint a = timeline.now(), b = timeline.now();
  EXPECT_EQ(a.device, nullptr);
  timeline.record("wait", EventKind::wait, a, b);
  const auto events = timeline.events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "work");
  EXPECT_LE(events[0].begin_us, events[0].end_us);
  EXPECT_EQ(events[1].kind, EventKind::wait);
  EXPECT_DOUBLE_EQ(events[1].begin_us, a.host_us);
  if (!MLACP_TORCH_2) {
    try {
      timeline.set_device(c10::Device(c10::DeviceType::CUDA, 0));
      ADD_FAILURE() << "a device timeline was accepted by a LibTorch without timing events";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("LibTorch 2.x"), std::string::npos) << e.what();
    }
  } else {
    timeline.set_device(c10::Device(c10::DeviceType::CUDA, 0));  // accepted; points need a GPU to be made
    EXPECT_TRUE(timeline.device_timed());
    EXPECT_TRUE(timeline.events().empty());  // switching clocks drops the other clock's spans
  }
}

TEST(AutocastSnapshot, CapturesTheTensorsDeviceType) {
  compat::AutocastGuard cpu(c10::DeviceType::CPU, true, at::kBFloat16);
  const auto on_cpu = compat::AutocastSnapshot::capture(c10::DeviceType::CPU);
  EXPECT_TRUE(on_cpu.enabled);
  EXPECT_EQ(on_cpu.device, c10::DeviceType::CPU);
  const auto on_cuda = compat::AutocastSnapshot::capture(c10::DeviceType::CUDA);  // CPU autocast is not CUDA's
  EXPECT_FALSE(on_cuda.enabled);
}

}  // namespace
}  // namespace mlacp
