// c10d's log switch held off for a while (private to src/comm).
#pragma once

#include <cstdlib>

#include <c10/util/Logging.h>

namespace mlacp {

// c10d's own log lines are off while the TCP store connects and while a group's ranks meet over
// it: glog's "[c10d] ..." lines on stderr (one a second while a client retries, one per timed-out
// wait for a rank that never comes), before mlacp's own line. The exception the store throws
// carries the same text, which becomes the mlacp error's cause. c10d logs only at levels >=
// caffe2_log_level (its ERROR is 2); TORCH_CPP_LOG_LEVEL, LibTorch's switch for its logs, is
// honoured when set. The flag is process-wide: other threads' c10d lines are off for that time too.
class QuietC10dLog {
 public:
  QuietC10dLog() : active_(std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr), saved_(FLAGS_caffe2_log_level) {
    if (active_) FLAGS_caffe2_log_level = 3;  // above c10d's ERROR
  }
  ~QuietC10dLog() {
    if (active_) FLAGS_caffe2_log_level = saved_;
  }
  QuietC10dLog(const QuietC10dLog&) = delete;
  QuietC10dLog& operator=(const QuietC10dLog&) = delete;

 private:
  bool active_;
  int saved_;
};

}  // namespace mlacp
