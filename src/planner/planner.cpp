// The planner's candidates, ranking and explanation (include/mlacp/planner.h, docs/DESIGN.md §15).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "mlacp/errors.h"
#include "mlacp/planner.h"
#include "mlacp/runtime.h"

namespace mlacp {
namespace {

using nlohmann::json;
constexpr const char* kWhat = "plan";

std::string seconds_text(double s) {
  char text[32];
  if (s >= 1.0)
    std::snprintf(text, sizeof text, "%.3g s", s);
  else if (s >= 1e-3)
    std::snprintf(text, sizeof text, "%.3g ms", s * 1e3);
  else
    std::snprintf(text, sizeof text, "%.3g us", s * 1e6);
  return text;
}

std::string percent(double part, double whole) {
  char text[32];
  const double pct = whole > 0 ? 100.0 * part / whole : 0.0;
  std::snprintf(text, sizeof text, pct < 10 ? "%.1f%%" : "%.0f%%", pct);
  return text;
}

std::string ratio_text(double r) {
  char text[32];
  std::snprintf(text, sizeof text, r >= 10 ? "%.0fx" : r >= 1.1 ? "%.2gx" : "%.3gx", r);
  return text;
}

std::string reason_of(const Error& e) {
  std::string text = e.rule();
  if (!e.values().empty()) {
    text += " (";
    for (size_t i = 0; i < e.values().size(); ++i) text += (i ? ", " : "") + e.values()[i].name + "=" + e.values()[i].value;
    text += ")";
  }
  return text;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

double phase(const CandidatePrediction& c, const std::string& name) {
  for (const auto& [n, s] : c.phases)
    if (n == name) return s;
  return 0.0;
}

// The explanation: the choice, what it costs, and the numbers that beat the best of each other
// family (the other strategy, another U, overlap off, another partition, another TP split).
std::string explain(const std::vector<CandidatePrediction>& ranked, const PlanRequest& request) {
  const CandidatePrediction& c = ranked.front();
  std::ostringstream out;
  out << "chosen: " << c.label() << ", predicted " << seconds_text(c.step_s) << " per layer step (compute "
      << seconds_text(c.compute_s) << ", exposed communication " << seconds_text(c.exposed_comm_s) << " of "
      << seconds_text(c.comm_s) << " sent).";
  const bool latent = c.spec.strategy == CpStrategy::latent_kv_head;
  auto best = [&](auto&& keep) -> const CandidatePrediction* {
    for (const CandidatePrediction& x : ranked)
      if (x.feasible && &x != &c && keep(x)) return &x;
    return nullptr;
  };
  if (const CandidatePrediction* o = best([&](const auto& x) { return x.spec.strategy != c.spec.strategy; })) {
    const CandidatePrediction& lat = latent ? c : *o;
    const CandidatePrediction& exp = latent ? *o : c;
    out << "\n" << (latent ? "latent" : "expanded") << " over " << o->label() << " (" << seconds_text(o->step_s) << ", "
        << ratio_text(o->step_s / c.step_s) << " the time): ";
    if (exp.bytes_per_rank > 0 && lat.bytes_per_rank > 0)
      out << "the K/V exchange moves " << ratio_text(exp.bytes_per_rank / lat.bytes_per_rank) << " the bytes of the latent's ("
          << format_bytes(exp.bytes_per_rank) << " vs " << format_bytes(lat.bytes_per_rank) << " per rank per step); ";
    out << "the latent's repeated up-projection costs " << seconds_text(lat.upprojection_s) << ", "
        << percent(lat.upprojection_s, lat.step_s) << " of its step at S=" << request.seq_len
        << " (expanded: " << seconds_text(exp.upprojection_s) << "); exposed communication " << seconds_text(c.exposed_comm_s)
        << " vs " << seconds_text(o->exposed_comm_s) << ".";
  }
  if (const CandidatePrediction* o = best([&](const auto& x) {
        return x.spec.strategy == c.spec.strategy && x.spec.tp == c.spec.tp && x.spec.ulysses != c.spec.ulysses;
      })) {
    out << "\nU=" << c.spec.ulysses << " over U=" << o->spec.ulysses << " (" << o->label() << ", "
        << seconds_text(o->step_s) << "): compute " << seconds_text(c.compute_s) << " vs " << seconds_text(o->compute_s)
        << " (attention " << seconds_text(phase(c, "attention") + phase(c, "attention_backward")) << " vs "
        << seconds_text(phase(*o, "attention") + phase(*o, "attention_backward")) << ", kv_b_proj "
        << seconds_text(c.upprojection_s) << " vs " << seconds_text(o->upprojection_s) << "), exposed communication "
        << seconds_text(c.exposed_comm_s) << " vs " << seconds_text(o->exposed_comm_s) << ".";
  }
  if (c.spec.overlap) {
    if (const CandidatePrediction* o = best([&](const auto& x) {
          return !x.spec.overlap && x.spec.strategy == c.spec.strategy && x.spec.ulysses == c.spec.ulysses &&
                 x.spec.partition == c.spec.partition && x.spec.tp == c.spec.tp;
        }))
      out << "\noverlap hides " << seconds_text(c.comm_s - c.exposed_comm_s) << " of " << seconds_text(c.comm_s)
          << " (without it: " << seconds_text(o->step_s) << ").";
  }
  if (const CandidatePrediction* o = best([&](const auto& x) {
        return x.spec.partition != c.spec.partition && x.spec.strategy == c.spec.strategy &&
               x.spec.ulysses == c.spec.ulysses && x.spec.overlap == c.spec.overlap && x.spec.tp == c.spec.tp;
      }))
    out << "\n" << partition_name(c.spec.partition) << " over " << partition_name(o->spec.partition)
        << ": the busiest rank's attention " << seconds_text(phase(c, "attention") + phase(c, "attention_backward"))
        << " vs " << seconds_text(phase(*o, "attention") + phase(*o, "attention_backward"))
        << (request.causal ? " (causal load balance)." : ".");
  if (c.spec.kv_recompute) {
    for (const CandidatePrediction& x : ranked)
      if (!x.feasible && !x.spec.kv_recompute && x.spec.strategy == c.spec.strategy && x.spec.ulysses == c.spec.ulysses &&
          x.spec.partition == c.spec.partition && x.spec.overlap == c.spec.overlap && x.spec.tp == c.spec.tp) {
        out << "\nkv_recompute: without it " << x.infeasible_reason << "; with it one layer needs "
            << format_bytes(c.memory_bytes) << " (one more kv_b_proj pass: " << seconds_text(c.upprojection_s)
            << " up-projection in the step).";
        break;
      }
  }
  if (const CandidatePrediction* o = best([&](const auto& x) { return x.spec.tp != c.spec.tp; }))
    out << "\ntp=" << c.spec.tp << " x cp=" << c.spec.cp << " over tp=" << o->spec.tp << " x cp=" << o->spec.cp << " ("
        << o->label() << ", " << seconds_text(o->step_s) << ").";
  size_t infeasible = 0;
  for (const CandidatePrediction& x : ranked) infeasible += x.feasible ? 0 : 1;
  if (infeasible > 0) out << "\n" << infeasible << " candidate(s) infeasible (listed with the rule they break).";
  return out.str();
}

}  // namespace

std::string CandidatePrediction::label() const {
  std::string s = strategy_name(spec.strategy) + " U=" + std::to_string(spec.ulysses) + " " +
                  partition_name(spec.partition) + " overlap " + (spec.overlap ? "on" : "off");
  if (spec.tp > 1) s += " tp=" + std::to_string(spec.tp);
  if (spec.kv_recompute) s += " kv_recompute";
  return s;
}

PlanReport plan_context_parallel(const PlanRequest& request) {
  const MlaConfig& c = request.config;
  c.validate();
  MLACP_REQUIRE(request.seq_len > 0, kWhat, "the sequence length must be > 0", {got("seq", request.seq_len)},
                "pass --seq");
  MLACP_REQUIRE(request.batch > 0, kWhat, "the batch must be > 0", {got("batch", request.batch)}, "pass --batch");
  MLACP_REQUIRE((request.devices > 0) != (request.cp > 0), kWhat, "give either a device count or a CP degree",
                {got("devices", request.devices), got("cp", request.cp)},
                "pass --gpus N (every tp x cp split) or --cp P [--tp T]");
  MLACP_REQUIRE(request.tp >= 1, kWhat, "tp must be >= 1", {got("tp", request.tp)}, "pass --tp 1 for no TP");
  MLACP_REQUIRE(request.dtype == "float32" || request.dtype == "bfloat16" || request.dtype == "float64", kWhat,
                "dtype must be float32, bfloat16 or float64", {got("dtype", request.dtype)}, "pass --dtype bfloat16");
  MLACP_REQUIRE(request.hardware.rates.count(request.dtype) == 1, kWhat, "the hardware has no rates for the run's dtype",
                {got("hardware", request.hardware.name), got("dtype", request.dtype)},
                "calibrate that dtype (mlacp plan --calibrate --dtype " + request.dtype + ") or pick another --dtype");

  std::vector<std::pair<int64_t, int64_t>> worlds;  // (tp, cp)
  if (request.devices > 0) {
    for (int64_t tp : divisors(request.devices))
      if (c.num_heads % tp == 0) worlds.emplace_back(tp, request.devices / tp);
  } else {
    worlds.emplace_back(request.tp, request.cp);
  }
  const std::vector<CpStrategy> strategies =
      request.strategies.empty() ? std::vector<CpStrategy>{CpStrategy::latent_kv_head, CpStrategy::expanded_ulysses}
                                 : request.strategies;
  const std::vector<CpPartition> partitions =
      request.partitions.empty() ? std::vector<CpPartition>{CpPartition::head_tail, CpPartition::contiguous}
                                 : request.partitions;
  const std::vector<bool> overlaps = request.overlaps.empty() ? std::vector<bool>{true, false} : request.overlaps;

  // One candidate: its plan's rules, the step model, and whether one layer fits in the memory.
  auto evaluate = [&](const CpPlanSpec& spec, bool* short_of_memory) {
    CandidatePrediction pred;
    pred.spec = spec;
    *short_of_memory = false;
    try {
      MLACP_REQUIRE(spec.tp <= request.hardware.devices_per_node, kWhat, "the TP group must fit in one node",
                    {got("tp", spec.tp), got("devices_per_node", request.hardware.devices_per_node)}, "use a smaller tp");
      CpPlan plan(spec);
      check_shardable(spec.partition, request.seq_len, spec.cp);
      pred = predict_step(plan, request);
      const Hardware& hw = request.hardware;
      double capacity = request.memory_per_rank_bytes;
      if (capacity <= 0 && hw.memory_bytes > 0) {
        capacity = hw.memory_bytes;
        if (hw.cores_per_node > 0)
          capacity /= static_cast<double>(std::min<int64_t>(spec.cp * spec.tp, hw.devices_per_node));
      }
      if (capacity > 0 && pred.memory_bytes > capacity) {
        pred.feasible = false;
        pred.infeasible_reason = "one layer's forward + backward needs " + format_bytes(pred.memory_bytes) +
                                 " per rank; the device has " + format_bytes(capacity);
        *short_of_memory = true;
      }
    } catch (const Error& e) {
      if (e.rule().rfind("internal", 0) == 0) throw;
      pred.feasible = false;
      pred.infeasible_reason = reason_of(e);
    }
    return pred;
  };

  std::vector<CandidatePrediction> all;
  for (const auto& [tp, cp] : worlds)
    for (CpStrategy strategy : strategies)
      for (int64_t u : request.ulysses > 0 ? std::vector<int64_t>{request.ulysses} : divisors(cp))
        for (CpPartition partition : partitions)
          for (bool overlap : overlaps) {
            if (cp == 1 && (overlap || partition == CpPartition::head_tail) &&
                !(overlaps.size() == 1 && partitions.size() == 1))
              continue;  // one rank: nothing to overlap or balance
            MeshShape shape;
            shape.cp = cp;
            shape.tp = tp;
            shape.ulysses = u;
            CpPlanSpec spec = plan_spec_for(c, shape, strategy, partition, overlap);
            spec.kernel = request.kernel;
            bool short_of_memory = false;
            all.push_back(evaluate(spec, &short_of_memory));
            // Short of memory: the latent strategy may keep the latent instead of head-block K/V.
            if (short_of_memory && request.kv_recompute_when_short && strategy == CpStrategy::latent_kv_head &&
                cp > 1 && request.kernel == AttentionKernel::blockwise) {
              spec.kv_recompute = true;
              all.push_back(evaluate(spec, &short_of_memory));
            }
          }
  std::stable_sort(all.begin(), all.end(), [](const CandidatePrediction& a, const CandidatePrediction& b) {
    if (a.feasible != b.feasible) return a.feasible;
    if (!a.feasible) return false;
    if (a.step_s != b.step_s) return a.step_s < b.step_s;
    return a.bytes_per_rank < b.bytes_per_rank;
  });

  PlanReport report;
  report.candidates = std::move(all);
  std::ostringstream summary;
  summary << "S=" << request.seq_len << " B=" << request.batch << " heads=" << c.num_heads << " hidden=" << c.hidden_size
          << " dtype=" << request.dtype << " "
          << (request.devices > 0 ? std::to_string(request.devices) + " devices"
                                  : "cp=" + std::to_string(request.cp) + " tp=" + std::to_string(request.tp))
          << " on " << request.hardware.name;
  report.summary = summary.str();
  if (report.any_feasible())
    report.explanation = explain(report.candidates, request);
  else
    report.explanation = "no candidate is feasible: " +
                         (report.candidates.empty() ? std::string("none to try") : report.candidates.front().infeasible_reason);
  return report;
}

std::string PlanReport::to_text(size_t max_rows) const {
  std::ostringstream out;
  out << "plan: " << summary << "\n\n";
  char line[512];
  std::snprintf(line, sizeof line, "%-4s %-50s %11s %11s %11s %11s %11s %11s\n", "rank", "candidate", "step", "compute",
                "exposed", "comm", "sent/rank", "memory");
  out << line << std::string(125, '-') << "\n";
  size_t shown = 0, feasible = 0;
  for (const CandidatePrediction& c : candidates) {
    if (!c.feasible) continue;
    ++feasible;
    if (shown == max_rows) continue;
    ++shown;
    std::snprintf(line, sizeof line, "%-4zu %-50s %11s %11s %11s %11s %11s %11s\n", shown, c.label().c_str(),
                  seconds_text(c.step_s).c_str(), seconds_text(c.compute_s).c_str(),
                  seconds_text(c.exposed_comm_s).c_str(), seconds_text(c.comm_s).c_str(),
                  format_bytes(c.bytes_per_rank).c_str(), format_bytes(c.memory_bytes).c_str());
    out << line;
  }
  if (feasible > shown) out << "(" << feasible - shown << " more feasible candidates: --json lists all)\n";
  bool header = false;
  for (const CandidatePrediction& c : candidates) {
    if (c.feasible) continue;
    if (!header) out << "\ninfeasible:\n";
    header = true;
    out << "  " << c.label() << ": " << c.infeasible_reason << "\n";
  }
  out << "\n" << explanation << "\n";
  return out.str();
}

std::string PlanReport::to_json() const {
  json j;
  j["summary"] = summary;
  j["explanation"] = explanation;
  j["chosen"] = any_feasible() ? json(chosen) : json(nullptr);
  j["candidates"] = json::array();
  for (const CandidatePrediction& c : candidates) {
    json x;
    x["label"] = c.label();
    x["strategy"] = strategy_name(c.spec.strategy);
    x["ulysses"] = c.spec.ulysses;
    x["cp"] = c.spec.cp;
    x["tp"] = c.spec.tp;
    x["partition"] = partition_name(c.spec.partition);
    x["overlap"] = c.spec.overlap;
    x["kv_recompute"] = c.spec.kv_recompute;
    x["feasible"] = c.feasible;
    if (!c.feasible) {
      x["infeasible_reason"] = c.infeasible_reason;
    } else {
      x["step_s"] = c.step_s;
      x["compute_s"] = c.compute_s;
      x["comm_s"] = c.comm_s;
      x["exposed_comm_s"] = c.exposed_comm_s;
      x["upprojection_s"] = c.upprojection_s;
      x["bytes_per_rank"] = c.bytes_per_rank;
      x["memory_bytes"] = c.memory_bytes;
      for (const auto& [name, s] : c.phases) x["phases_s"][name] = s;
      for (const TransferPrediction& t : c.transfers)
        x["transfers"][t.name] = {{"bytes", t.bytes}, {"seconds", t.seconds}, {"hidden_s", t.hidden_s}};
    }
    j["candidates"].push_back(x);
  }
  return j.dump(2);
}

}  // namespace mlacp
