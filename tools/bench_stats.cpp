#include "bench_stats.h"

#include <algorithm>

namespace mlacp::tools {

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  if (values.size() % 2 == 1) return values[mid];
  const double upper = values[mid];
  return 0.5 * (upper + *std::max_element(values.begin(), values.begin() + mid));
}

double median_step_us(const std::vector<StepSample>& steps) {
  std::vector<double> v;
  for (const auto& s : steps) v.push_back(s.step_us);
  return median(v);
}

LabelTimes median_by_label(const std::vector<StepSample>& steps, LabelTimes StepSample::*field) {
  std::map<std::string, std::vector<double>> values;
  for (const auto& s : steps)
    for (const auto& [label, us] : s.*field) values[label].push_back(us);
  LabelTimes out;
  for (auto& [label, v] : values) {
    v.resize(steps.size(), 0.0);  // a step without this label counts as zero
    out[label] = median(v);
  }
  return out;
}

double median_paired_saving_us(const std::vector<StepSample>& off, const std::vector<StepSample>& on) {
  std::vector<double> d;
  for (size_t i = 0; i < std::min(off.size(), on.size()); ++i) d.push_back(off[i].step_us - on[i].step_us);
  return median(d);
}

double sum(const LabelTimes& times, const std::set<std::string>* only) {
  double total = 0;
  for (const auto& [label, us] : times)
    if (!only || only->count(label)) total += us;
  return total;
}

std::string plain_label_of(const std::string& label, const std::map<std::string, int64_t>& plain_bytes) {
  const bool packed_forward = plain_bytes.count("qkv") > 0, packed_backward = plain_bytes.count("dqkv") > 0;
  if (packed_forward && (label == "q" || label == "k" || label == "v" || label == "kv")) return "qkv";
  if (packed_backward && (label == "dq" || label == "dk" || label == "dv" || label == "dkv")) return "dqkv";
  return label;
}

double exposed_without_overlap_us(const std::set<std::string>& labels, const LabelTimes& plain_exposed_us,
                                  const std::map<std::string, int64_t>& plain_bytes,
                                  const std::map<std::string, int64_t>& overlapped_bytes) {
  double total = 0;
  for (const auto& label : labels) {
    const std::string plain = plain_label_of(label, plain_bytes);
    auto exposed = plain_exposed_us.find(plain);
    auto whole = plain_bytes.find(plain);
    auto part = overlapped_bytes.find(label);
    if (exposed == plain_exposed_us.end() || whole == plain_bytes.end() || part == overlapped_bytes.end() ||
        whole->second <= 0)
      continue;
    total += exposed->second * static_cast<double>(part->second) / static_cast<double>(whole->second);
  }
  return total;
}

double bandwidth_for_fraction(const std::set<std::string>& labels, const LabelTimes& compute_under_us,
                              const std::map<std::string, int64_t>& bytes, double fraction) {
  double needed = 0;
  for (const auto& label : labels) {
    auto under = compute_under_us.find(label);
    auto b = bytes.find(label);
    if (under == compute_under_us.end() || b == bytes.end() || under->second <= 0) continue;
    needed = std::max(needed, static_cast<double>(b->second) / (fraction * under->second * 1e-6));
  }
  return needed;
}

double transfer_duration_us(const std::string& label, bool overlapped, const LinkTime& link,
                            const std::vector<StepSample>& off, const std::vector<StepSample>& on) {
  const auto& bytes = (overlapped ? on : off).front().bytes;
  auto b = bytes.find(label);
  if (b == bytes.end()) return 0.0;
  if (link) return link(b->second);
  const LabelTimes off_exposed = median_by_label(off, &StepSample::exposed_us);
  if (!overlapped) return off_exposed.count(label) ? off_exposed.at(label) : 0.0;
  return exposed_without_overlap_us({label}, off_exposed, off.front().bytes, on.front().bytes);
}

OverlapSummary summarize_overlap(const std::vector<StepSample>& off, const std::vector<StepSample>& on,
                                 const std::set<std::string>& labels, const LinkTime& link) {
  OverlapSummary r;
  if (off.empty() || on.empty()) return r;
  const auto& on_bytes = on.front().bytes;
  const LabelTimes on_exposed = median_by_label(on, &StepSample::exposed_us);
  const LabelTimes on_under = median_by_label(on, &StepSample::compute_under_us);
  for (const auto& label : labels) {
    if (!on_bytes.count(label)) continue;
    const double d = transfer_duration_us(label, true, link, off, on);
    r.comm_us += d;
    auto under = on_under.find(label);
    if (under != on_under.end() && under->second > 0)
      r.max_transfer_to_compute = std::max(r.max_transfer_to_compute, d / under->second);
  }
  // A transfer queued on the link behind overlapped ones waits longer than its own duration: that
  // excess is theirs too.
  if (link) {
    for (const auto& [label, us] : on_exposed)
      if (!labels.count(label) && on_bytes.count(label))
        r.queued_us += std::max(0.0, us - transfer_duration_us(label, true, link, off, on));
  }
  r.exposed_on_us = sum(on_exposed, &labels) + r.queued_us;
  r.exposed_off_us = exposed_without_overlap_us(labels, median_by_label(off, &StepSample::exposed_us),
                                                off.front().bytes, on_bytes);
  r.saved_us = median_step_us(off) - median_step_us(on);
  r.paired_saved_us = median_paired_saving_us(off, on);
  return r;
}

}  // namespace mlacp::tools
