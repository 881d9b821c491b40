#include "core/timeline.h"

#include <chrono>

#include <nlohmann/json.hpp>

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

void Timeline::record(const std::string& name, EventKind kind, double begin_us, double end_us) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({name, kind, begin_us, end_us});
}

std::vector<TimelineEvent> Timeline::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
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
  if (timeline_) begin_us_ = Timeline::now_us();
}

ComputeSpan::~ComputeSpan() {
  if (timeline_) timeline_->record(name_, EventKind::compute, begin_us_, Timeline::now_us());
}

}  // namespace mlacp
