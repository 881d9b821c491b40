// A per-process timeline of compute spans, collective launches and waits (docs/DESIGN.md §10): what the
// overlap schedules are judged by. Written as a Chrome/Perfetto trace, one track per rank.
// Recording is off unless enabled; when off, every call is a cheap no-op.
#pragma once

#include <mutex>
#include <string>
#include <vector>

namespace mlacp {

enum class EventKind { compute, launch, wait, transfer };
std::string event_kind_name(EventKind kind);

struct TimelineEvent {
  std::string name;  // e.g. "q_b_proj", "q", "dO"
  EventKind kind;
  double begin_us;
  double end_us;  // == begin_us for a launch
};

class Timeline {
 public:
  static double now_us();  // steady clock, microseconds
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  void record(const std::string& name, EventKind kind, double begin_us, double end_us);
  std::vector<TimelineEvent> events() const;
  void clear();
  // Chrome trace JSON ("traceEvents"), pid = rank so each rank is its own track.
  std::string chrome_trace_json(int64_t rank) const;

 private:
  bool enabled_ = false;
  mutable std::mutex mutex_;
  std::vector<TimelineEvent> events_;
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
  double begin_us_ = 0.0;
};

}  // namespace mlacp
