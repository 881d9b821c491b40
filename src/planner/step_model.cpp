// The model of one candidate's step (include/mlacp/planner.h, docs/DESIGN.md §15): compute phases
// from FLOPs and rates, collectives from the byte formulas on their group's link level, and what
// overlap hides from the schedule's own declaration of which transfer sits under which span.
#include <algorithm>
#include <cmath>
#include <map>

#include "mlacp/errors.h"
#include "mlacp/planner.h"
#include "mlacp/runtime.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "plan";

enum class Kind { all_to_all, all_gather, reduce_scatter, all_reduce };

// Sum over the query tokens [lo, hi) of the keys each sees (causal: position + 1; else S).
double visible_pairs(int64_t lo, int64_t hi, int64_t seq_len, bool causal) {
  const double n = static_cast<double>(hi - lo);
  if (!causal) return n * static_cast<double>(seq_len);
  return n * (static_cast<double>(lo) + static_cast<double>(hi) + 1.0) / 2.0;
}

// Query-key pairs of CP rank r's own tokens (per sequence).
double rank_pairs(CpPartition partition, int64_t seq_len, int64_t cp, int64_t r, bool causal) {
  if (partition == CpPartition::contiguous) {
    const int64_t local = seq_len / cp;
    return visible_pairs(r * local, (r + 1) * local, seq_len, causal);
  }
  const int64_t chunk = seq_len / (2 * cp);
  return visible_pairs(r * chunk, (r + 1) * chunk, seq_len, causal) +
         visible_pairs((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk, seq_len, causal);
}

int64_t element_bytes(const std::string& dtype) {
  if (dtype == "float64") return 8;
  if (dtype == "bfloat16") return 2;
  return 4;
}

// Time of a collective sending `bytes` per rank over a group of `size` ranks whose members are
// `stride` world ranks apart (TP innermost: docs/DESIGN.md §2).
double collective_seconds(const Hardware& hw, Kind kind, double bytes, int64_t size, int64_t stride) {
  if (bytes <= 0 || size <= 1) return 0.0;
  auto over = [](const LinkLevel& link, double b) {
    return link.bandwidth_bytes_per_s > 0 ? b / link.bandwidth_bytes_per_s : 0.0;
  };
  const int64_t per_node = hw.devices_per_node;
  if (size * stride <= per_node) return hw.intra_node.latency_s + over(hw.intra_node, bytes);
  // The group spans nodes. A ring (all-gather, reduce-scatter, all-reduce) passes every byte over
  // a node-crossing hop; an all-to-all sends the share bound for other nodes over the network.
  const double latency = hw.inter_node.latency_s;
  const int64_t members_per_node = std::max<int64_t>(1, per_node / stride);
  if (kind != Kind::all_to_all) {
    // A shared node link: the rings of this kind cross it per_node / m at once (m = this ring's
    // members on a node), so each has m ranks' share of it.
    LinkLevel ring = hw.inter_node;
    if (hw.shared_node_link) ring.bandwidth_bytes_per_s *= static_cast<double>(std::min(size, members_per_node));
    return latency + over(ring, bytes);
  }
  const double off_node = static_cast<double>(size - std::min(size, members_per_node)) / static_cast<double>(size - 1);
  return latency + std::max(over(hw.inter_node, bytes * off_node), over(hw.intra_node, bytes * (1.0 - off_node)));
}

// bench's emulated link: the collective's wait ends no earlier than the link model's time after
// its launch, whatever the backend does (LinkModel, include/mlacp/comm.h).
double with_emulated_link(const PlanRequest& request, double backend_s, double bytes) {
  LinkModel emulated;
  emulated.latency_seconds = request.emulated_link.latency_s;
  emulated.bandwidth_bytes_per_second = request.emulated_link.bandwidth_bytes_per_s;
  if (!emulated.enabled()) return backend_s;
  return std::max(backend_s, emulated.transfer_seconds(static_cast<int64_t>(bytes)));
}

}  // namespace

double gemm_rate_at(const ComputeRates& rates, double tokens) {
  const auto& curve = rates.gemm_flops_by_tokens;
  if (curve.empty()) return rates.gemm_flops;
  if (tokens <= curve.front().first) return curve.front().second;
  if (tokens >= curve.back().first) return curve.back().second;
  for (size_t i = 1; i < curve.size(); ++i)
    if (tokens <= curve[i].first) {
      const double f = std::log(tokens / curve[i - 1].first) / std::log(curve[i].first / curve[i - 1].first);
      return curve[i - 1].second + f * (curve[i].second - curve[i - 1].second);
    }
  return curve.back().second;
}

int64_t transfer_elements(const CpPlan& plan, int64_t batch, int64_t seq_len, const std::string& transfer) {
  const PlanDims& d = plan.dims();
  const int64_t p = plan.cp(), u = plan.ulysses(), a = plan.all_gather();
  const int64_t t = batch * seq_len / p, h = plan.local_heads();
  const bool expanded = plan.strategy() == CpStrategy::expanded_ulysses;
  auto exchange = [&](int64_t width) { return t * h * width * (u - 1) / u; };
  const std::string name = transfer.size() > 1 && transfer[0] == 'd' && transfer != "dO" ? transfer.substr(1) : transfer;
  if (name == "o" || transfer == "dO") return exchange(d.value_dim);
  if (name == "q") return exchange(d.qk_dim());
  if (!expanded) return name == "latent" ? (p - 1) * t * (d.kv_rank + d.rope_dim) : 0;
  if (name == "k") return exchange(d.qk_dim());
  if (name == "v") return exchange(d.value_dim);
  if (name == "kv") return exchange(d.qk_dim() + d.value_dim);
  if (name == "qkv") return exchange(2 * d.qk_dim() + d.value_dim);
  if (name == "kv_gather") return (a - 1) * t * h * (d.qk_dim() + d.value_dim);
  return 0;
}

CandidatePrediction predict_step(const CpPlan& plan, const PlanRequest& request) {
  const MlaConfig& c = request.config;
  const Hardware& hw = request.hardware;
  const auto rates_it = hw.rates.find(request.dtype);
  MLACP_REQUIRE(rates_it != hw.rates.end(), kWhat, "the hardware has no rates for the run's dtype",
                {got("hardware", hw.name), got("dtype", request.dtype)},
                "calibrate that dtype (mlacp plan --calibrate --dtype " + request.dtype + ") or pick another --dtype");
  const ComputeRates& rate = rates_it->second;
  MLACP_REQUIRE(rate.gemm_flops > 0 && rate.attention_forward_flops > 0 && rate.attention_backward_flops > 0, kWhat,
                "the hardware's rates must be positive", {got("hardware", hw.name), got("dtype", request.dtype)},
                "fix the hardware file or re-run mlacp plan --calibrate");

  CandidatePrediction out;
  out.spec = plan.spec();
  const PlanDims& d = plan.dims();
  const double B = static_cast<double>(request.batch), S = static_cast<double>(request.seq_len);
  const int64_t P = plan.cp(), U = plan.ulysses(), A = plan.all_gather(), tp = plan.tp();
  const double n = B * S / static_cast<double>(P);  // this rank's tokens
  const double H = static_cast<double>(plan.local_heads()), Hc = static_cast<double>(plan.head_block_size());
  const double hidden = static_cast<double>(c.hidden_size), Rq = static_cast<double>(d.q_rank);
  const double Rkv = static_cast<double>(d.kv_rank), Dr = static_cast<double>(d.rope_dim);
  const double Dqk = static_cast<double>(d.qk_dim()), Dn = static_cast<double>(d.nope_dim);
  const double Dv = static_cast<double>(d.value_dim);
  const bool latent = plan.strategy() == CpStrategy::latent_kv_head;

  // Ranks of one node share its cores (CPU hosts); a GPU rank has its device.
  const int64_t world = P * tp;
  double share = 1.0;
  if (hw.cores_per_node > 0)
    share = static_cast<double>(hw.cores_per_node) / static_cast<double>(std::min(world, hw.devices_per_node));

  // Attention: the busiest Ulysses group (its rows are the tokens of U consecutive CP ranks).
  double group_pairs = 0, own_pairs = 0;
  for (int64_t g = 0; g < A; ++g) {
    double pairs = 0, first = 0;
    for (int64_t r = g * U; r < (g + 1) * U; ++r) {
      const double rp = rank_pairs(plan.partition(), request.seq_len, P, r, request.causal);
      pairs += rp;
      if (r == g * U) first = rp;
    }
    if (pairs > group_pairs) {
      group_pairs = pairs;
      own_pairs = first;
    }
  }
  const double attention_forward_flops = 2.0 * B * Hc * group_pairs * (Dqk + Dv);
  const double attention_forward_s = attention_forward_flops / (rate.attention_forward_flops * share);
  const double attention_backward_s = 2.5 * attention_forward_flops / (rate.attention_backward_flops * share);

  // Forward GEMM seconds per projection; backward is twice (dgrad + wgrad).
  auto gemm = [&](double m, double k, double nn) { return 2.0 * m * k * nn / (gemm_rate_at(rate, m) * share); };
  const double q_a = c.q_lora_rank ? gemm(n, hidden, Rq) : 0.0;
  const double kv_a = gemm(n, hidden, Rkv + Dr);
  const double q_b = gemm(n, Rq, H * Dqk);
  const double kv_b = latent ? gemm(B * S, Rkv, Hc * (Dn + Dv)) : gemm(n, Rkv, H * (Dn + Dv));
  const double gate = c.output_gate ? gemm(n, hidden, H * Dv) : 0.0;
  const double o = gemm(n, H * Dv, hidden);

  // Elementwise work, proportional to the activations the layer touches (the memory model's count).
  LayerShape shape;
  shape.batch = request.batch;
  shape.seq_len = request.seq_len;
  shape.hidden = c.hidden_size;
  shape.q_latent = c.q_lora_rank.has_value();
  shape.output_gate = c.output_gate;
  shape.element_bytes = 1;
  shape.backward = false;
  double activation_elements = 0;
  for (const auto& [name, v] : layer_memory(plan, shape).parts)
    if (name == "activations") activation_elements = v;
  const double elementwise = activation_elements * rate.seconds_per_element / share;

  // kv_b_proj: forward, dgrad, wgrad; K/V recompute runs its forward again in the backward.
  const double kv_b_passes = plan.kv_recompute() ? 4.0 : 3.0;
  out.phases = {{"q_a_proj", 3 * q_a},         {"kv_a_proj", 3 * kv_a},         {"q_b_proj_rope", 3 * q_b},
                {"kv_b_proj", kv_b_passes * kv_b},       {"gate_proj", 3 * gate},         {"o_proj", 3 * o},
                {"attention", attention_forward_s}, {"attention_backward", attention_backward_s},
                {"elementwise", elementwise}};
  for (const auto& [name, s] : out.phases) out.compute_s += s;
  out.activation_elements = activation_elements;
  out.upprojection_s = kv_b_passes * kv_b;

  // The collectives of the step, by transfer name, with their group.
  struct Group {
    int64_t size, stride;
  };
  const Group ulysses{U, tp}, gather{A, U * tp}, cp{P, tp};
  std::vector<std::tuple<std::string, Kind, Group>> list;
  auto a2a = [&](const char* name) { list.emplace_back(name, Kind::all_to_all, ulysses); };
  const bool overlapped = plan.overlap() && P > 1;
  if (latent) {
    a2a("q");
    list.emplace_back("latent", Kind::all_gather, cp);
    a2a("o"), a2a("dO"), a2a("dq");
    list.emplace_back("dlatent", Kind::reduce_scatter, cp);
  } else if (A == 1) {
    if (overlapped) {
      for (const char* t : {"q", "k", "v", "o", "dO", "dq", "dk", "dv"}) a2a(t);
    } else {
      for (const char* t : {"qkv", "o", "dO", "dqkv"}) a2a(t);
    }
  } else {
    if (overlapped) {
      a2a("q"), a2a("kv");
    } else {
      a2a("qkv");
    }
    list.emplace_back("kv_gather", Kind::all_gather, gather);
    a2a("o"), a2a("dO");
    if (overlapped) {
      a2a("dq"), a2a("dkv");
    } else {
      a2a("dqkv");
    }
    list.emplace_back("dkv_gather", Kind::reduce_scatter, gather);
  }
  const double e = static_cast<double>(element_bytes(request.dtype));
  for (const auto& [name, kind, group] : list) {
    const double bytes = static_cast<double>(transfer_elements(plan, request.batch, request.seq_len, name)) * e;
    if (bytes <= 0) continue;
    TransferPrediction t;
    t.name = name;
    t.bytes = bytes;
    t.seconds = with_emulated_link(request, collective_seconds(hw, kind, bytes, group.size, group.stride), bytes);
    out.transfers.push_back(t);
  }
  if (tp > 1) {  // the TP exit's all-reduce (forward) and the entry's (backward), of [T, d]
    const double bytes = 2.0 * n * hidden * e * static_cast<double>(tp - 1) / static_cast<double>(tp);
    for (const char* name : {"tp_output", "tp_input_grad"})
      out.transfers.push_back(
          {name, bytes, with_emulated_link(request, collective_seconds(hw, Kind::all_reduce, bytes, tp, 1), bytes), 0.0});
  }

  // Overlap: each declared transfer hides under what is left of the spans it is launched before.
  if (overlapped) {
    std::map<std::string, double> span_left = {
        {"q_b_proj_rope", q_b},          {"q_b_proj_rope_backward", 2 * q_b}, {"kv_b_proj", kv_b},
        {"kv_b_proj_dgrad", kv_b},       {"kv_b_proj_wgrad", kv_b},           {"o_proj_wgrad", o},
        {"gate_proj", gate},             {"gate_proj_backward", 2 * gate},    {"build_k", 0.0},
        {"build_k_backward", 0.0},
        {"attention_own_rows", group_pairs > 0 ? attention_forward_s * own_pairs / group_pairs : 0.0}};
    // CPU hosts (cores per node) run the blockwise kernel's own-rows split; devices do not.
    // device: CPU hosts run the blockwise kernel's own-rows split
    const c10::DeviceType device = hw.cores_per_node > 0 ? c10::DeviceType::CPU : c10::DeviceType::CUDA;
    for (const OverlappedTransfer& declared : overlapped_transfers(plan, c, device)) {
      const std::string name = transfer_name(declared.transfer);
      auto t = std::find_if(out.transfers.begin(), out.transfers.end(),
                            [&](const TransferPrediction& x) { return x.name == name; });
      if (t == out.transfers.end()) continue;  // empty for these degrees
      double need = t->seconds;
      for (const std::string& span : declared.under) {
        auto left = span_left.find(span);
        MLACP_REQUIRE(left != span_left.end(), kWhat,
                      "internal: a schedule declares a span the step model does not know",
                      {got("span", span), got("transfer", name)}, "add the span to src/planner/step_model.cpp");
        const double used = std::min(need, left->second);
        left->second -= used;
        need -= used;
        t->hidden_s += used;
      }
    }
  }
  for (const TransferPrediction& t : out.transfers) {
    out.comm_s += t.seconds;
    out.exposed_comm_s += t.seconds - t.hidden_s;
    out.bytes_per_rank += t.bytes;
  }
  out.step_s = out.compute_s + out.exposed_comm_s;

  // Bytes as bench and train count them: parameters, gradients and the projections' activations
  // at float32 width under bf16 autocast, what attention exchanges and its kernel's buffers at bf16.
  LayerShape memory_shape = shape;
  memory_shape.element_bytes = request.dtype == "float64" ? 8 : 4;
  memory_shape.attention_bytes = request.dtype == "bfloat16" ? 2 : 0;
  memory_shape.backward = true;
  out.memory_bytes = layer_memory(plan, memory_shape).total();
  return out;
}

}  // namespace mlacp
