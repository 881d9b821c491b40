// What `mlacp bench` computes from the timelines of its steps. Pure functions over per-step
// samples (already combined over the ranks), so they are tested without ranks.
//
// Exposure is measured on the critical path: for each collective, the time the *last* rank to
// arrive spends blocked in its wait (the minimum over ranks). An earlier rank also waits for the
// late one to arrive; that part is load imbalance between ranks, not communication, and overlap
// can neither cause nor remove it. It is reported separately (`blocked_us`, the maximum).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace mlacp::tools {

using LabelTimes = std::map<std::string, double>;  // microseconds per collective label

// One timed step, combined over the ranks.
struct StepSample {
  double step_us = 0;           // the slowest rank's step (forward + backward)
  LabelTimes exposed_us;        // min over ranks of the time blocked in the label's waits
  LabelTimes blocked_us;        // max over ranks (includes waiting for a late peer)
  LabelTimes compute_under_us;  // min over ranks of launch-to-wait: the work placed under it
  LabelTimes compute_us;        // per compute span name: max over ranks of its time in the step
                                // (with overlap on, transfers running under a span can slow it)
  std::map<std::string, int64_t> bytes;          // bytes per rank per label (equal on every rank)
  std::map<std::string, int64_t> bytes_by_kind;  // per collective kind name
  double peak_bytes = 0;        // max over ranks of the tensor bytes the step allocated at its highest
};

double median(std::vector<double> values);
double median_step_us(const std::vector<StepSample>& steps);
// Median over steps of each label's value of `field`.
LabelTimes median_by_label(const std::vector<StepSample>& steps, LabelTimes StepSample::*field);
// Median over i of off[i].step_us - on[i].step_us (steps taken in alternation).
double median_paired_saving_us(const std::vector<StepSample>& off, const std::vector<StepSample>& on);

double sum(const LabelTimes& times, const std::set<std::string>* only = nullptr);

// With overlap off, the exchange that carries a transfer of the overlapped schedule: the plain
// path packs Q, K, V (and K|V of hybrids) into one "qkv" exchange and their gradients into
// "dqkv"; every other transfer has the same name in both forms (transfer_name()).
std::string plain_label_of(const std::string& overlapped_label, const std::map<std::string, int64_t>& plain_bytes);

// The time the transfers `labels` of the overlapped schedule were exposed with overlap off: each
// plain exchange's exposure in proportion to the share of its bytes they make up.
double exposed_without_overlap_us(const std::set<std::string>& labels, const LabelTimes& plain_exposed_us,
                                  const std::map<std::string, int64_t>& plain_bytes,
                                  const std::map<std::string, int64_t>& overlapped_bytes);

// The link bandwidth (bytes/s) at which each transfer in `labels` takes at most `fraction` of the
// computation placed under it, the tightest one exactly that. 0 when no label has both.
double bandwidth_for_fraction(const std::set<std::string>& labels, const LabelTimes& compute_under_us,
                              const std::map<std::string, int64_t>& bytes, double fraction);

// The link's time for a transfer of `bytes`, in microseconds; empty when there is no link.
using LinkTime = std::function<double(int64_t bytes)>;

// A transfer's duration: the link's time for its bytes; with no link, what it cost exposed with
// overlap off (a transfer of the overlapped schedule: its share of the plain exchange).
double transfer_duration_us(const std::string& label, bool overlapped, const LinkTime& link,
                            const std::vector<StepSample>& off, const std::vector<StepSample>& on);

// What overlap did for the transfers `labels` the schedule places under computation, from the
// timed steps of both modes (taken in alternation).
struct OverlapSummary {
  double comm_us = 0;            // their summed duration
  double exposed_on_us = 0;      // their exposure with overlap on, queued_us included
  double queued_us = 0;          // other transfers' waits beyond their own duration (queued behind them)
  double exposed_off_us = 0;     // their exposure with overlap off
  double saved_us = 0;           // median step off - median step on
  double paired_saved_us = 0;    // median of per-step differences
  double max_transfer_to_compute = 0;  // the largest duration / computation placed under it
  double hidden_percent() const { return comm_us > 0 ? 100.0 * (1.0 - exposed_on_us / comm_us) : 100.0; }
  double saved_percent() const { return exposed_off_us > 0 ? 100.0 * saved_us / exposed_off_us : 0.0; }
  // Issue 4's acceptance: at least 90% hidden, and at least 80% of the exposed-off time saved.
  bool met() const { return hidden_percent() >= 90.0 && saved_percent() >= 80.0; }
};
OverlapSummary summarize_overlap(const std::vector<StepSample>& off, const std::vector<StepSample>& on,
                                 const std::set<std::string>& labels, const LinkTime& link);

}  // namespace mlacp::tools
