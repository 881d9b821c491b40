// A per-process timeline of compute spans, collective launches and waits (docs/DESIGN.md §10): what the
// overlap schedules are judged by. Written as a Chrome/Perfetto trace, one track per rank.
// Recording is off unless enabled; when off, every call is a cheap no-op.
//
// Clocks (docs/DESIGN.md §16): on the CPU a point is the host's steady clock. On a device
// (set_device(cuda)) a point is also a timing event recorded on the device's current stream, so a
// span is what the device executed between the two points, not how long the host took to enqueue
// it, and a wait span is how long the compute stream stood still for a collective: exposed
// communication measured on the GPU as it is on the CPU. Device points are resolved when events()
// is read (it waits for the device: read it after a step, never inside one).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace mlacp {

class DeviceTimePoint;  // core/device.h

enum class EventKind { compute, launch, wait, transfer };
std::string event_kind_name(EventKind kind);

struct TimelineEvent {
  std::string name;  // e.g. "q_b_proj", "q", "dO"
  EventKind kind;
  double begin_us;
  double end_us;  // == begin_us for a launch
};

// One instant: the host clock, and on a device-timed timeline a point on the device's stream.
struct TimePoint {
  double host_us = 0.0;
  std::shared_ptr<DeviceTimePoint> device;  // null on the CPU
  uint64_t sequence = 0;                    // order of making (device points: the stream's order)
};

class Timeline {
 public:
  static double now_us();  // steady clock, microseconds
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  // Times spans on `device` (CPU: the host clock, the default). Errors where this LibTorch cannot
  // time device points (1.13).
  void set_device(const c10::Device& device);
  const c10::Device& device() const { return device_; }
  // device: the host clock serves the CPU
  bool device_timed() const { return !device_.is_cpu(); }
  TimePoint now() const;
  void record(const std::string& name, EventKind kind, double begin_us, double end_us);
  void record(const std::string& name, EventKind kind, const TimePoint& begin, const TimePoint& end);
  // Every event in microseconds; device points relative to the earliest one made since the last
  // clear(), placed at that point's host time.
  std::vector<TimelineEvent> events() const;
  void clear();
  // Chrome trace JSON ("traceEvents"), pid = rank so each rank is its own track.
  std::string chrome_trace_json(int64_t rank) const;

 private:
  struct Span {
    std::string name;
    EventKind kind;
    TimePoint begin, end;
  };
  bool enabled_ = false;
  mutable uint64_t made_ = 0;  // points made (under mutex_)
  // device: the default: the host clock
  c10::Device device_{c10::DeviceType::CPU};
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
};

// Records a compute span for its lifetime (no-op when the timeline is null or disabled).
class ComputeSpan {
 public:
  ComputeSpan(Timeline* timeline, std::string name);
  ~ComputeSpan();
  ComputeSpan(const ComputeSpan&) = delete;
  ComputeSpan& operator=(const ComputeSpan&) = delete;

 private:
  Timeline* timeline_;
  std::string name_;
  TimePoint begin_;
};

}  // namespace mlacp
