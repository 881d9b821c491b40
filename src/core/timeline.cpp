#include "core/timeline.h"

#include <chrono>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "mlacp/errors.h"

namespace mlacp {

std::string event_kind_name(EventKind kind) {
  switch (kind) {
    case EventKind::compute: return "compute";
    case EventKind::launch: return "launch";
    case EventKind::wait: return "wait";
    case EventKind::transfer: return "transfer";
  }
  return "?";
}

double Timeline::now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Timeline::set_device(const c10::Device& device) {
  // device: the CPU's clock is the host's; a device's needs timing events
  MLACP_REQUIRE(device.is_cpu() || device_timing_available(), "timeline",
                "spans on a device are timed with device events, which need LibTorch 2.x", {got("device", device)},
                "build against the PyTorch 2.x wheel's LibTorch");
  std::lock_guard<std::mutex> lock(mutex_);
  device_ = device;
  spans_.clear();
}

TimePoint Timeline::now() const {
  TimePoint p;
  p.host_us = now_us();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    p.sequence = made_++;
  }
  // device: a device point is an event on the device's stream
  if (!device_.is_cpu()) p.device = std::make_shared<DeviceTimePoint>(device_);
  return p;
}

void Timeline::record(const std::string& name, EventKind kind, double begin_us, double end_us) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({name, kind, {begin_us, nullptr}, {end_us, nullptr}});
}

void Timeline::record(const std::string& name, EventKind kind, const TimePoint& begin, const TimePoint& end) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({name, kind, begin, end});
}

std::vector<TimelineEvent> Timeline::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<TimelineEvent> out;
  out.reserve(spans_.size());
  // The earliest device point (spans are recorded when they end, so not necessarily the first
  // span's): device times are placed relative to it, every difference non-negative.
  const TimePoint* origin = nullptr;
  for (const Span& s : spans_) {
    for (const TimePoint* p : {&s.begin, &s.end})
      if (p->device && (!origin || p->sequence < origin->sequence)) origin = p;
  }
  auto time_of = [&](const TimePoint& p) {
    if (!p.device || !origin) return p.host_us;
    return origin->host_us + 1000.0 * origin->device->milliseconds_until(*p.device);
  };
  for (const Span& s : spans_) out.push_back({s.name, s.kind, time_of(s.begin), time_of(s.end)});
  return out;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.clear();
}

std::string Timeline::chrome_trace_json(int64_t rank) const {
  nlohmann::json trace = nlohmann::json::array();
  // Thread ids inside the rank's track: compute 0, waits 1, transfers 2 (launches are instants).
  for (const TimelineEvent& e : events()) {
    nlohmann::json item{{"name", e.name}, {"cat", event_kind_name(e.kind)}, {"pid", rank}, {"ts", e.begin_us}};
    switch (e.kind) {
      case EventKind::compute: item["ph"] = "X"; item["tid"] = 0; item["dur"] = e.end_us - e.begin_us; break;
      case EventKind::wait: item["ph"] = "X"; item["tid"] = 1; item["dur"] = e.end_us - e.begin_us; break;
      case EventKind::transfer: item["ph"] = "X"; item["tid"] = 2; item["dur"] = e.end_us - e.begin_us; break;
      case EventKind::launch: item["ph"] = "i"; item["tid"] = 2; item["s"] = "t"; break;
    }
    trace.push_back(item);
  }
  trace.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  return nlohmann::json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}}.dump();
}

ComputeSpan::ComputeSpan(Timeline* timeline, std::string name)
    : timeline_(timeline && timeline->enabled() ? timeline : nullptr), name_(std::move(name)) {
  if (timeline_) begin_ = timeline_->now();
}

ComputeSpan::~ComputeSpan() {
  if (timeline_) timeline_->record(name_, EventKind::compute, begin_, timeline_->now());
}

}  // namespace mlacp
