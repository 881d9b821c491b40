// Memory estimates from shapes (include/mlacp/memory.h, docs/DESIGN.md §8).
#include "mlacp/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "mlacp/errors.h"

namespace mlacp {

double MemoryEstimate::total() const {
  double sum = 0;
  for (const auto& [name, bytes] : parts) sum += bytes;
  return sum;
}

void MemoryEstimate::add(const std::string& name, double bytes) {
  for (auto& [n, b] : parts)
    if (n == name) {
      b += bytes;
      return;
    }
  parts.emplace_back(name, bytes);
}

void MemoryEstimate::add(const MemoryEstimate& other, double times, const std::string& prefix) {
  for (const auto& [name, bytes] : other.parts) add(prefix + name, bytes * times);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double v = bytes;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char text[64];
  if (!std::isfinite(bytes)) return "more than 8 EiB";
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return text;
}

std::string MemoryEstimate::to_text() const {
  std::vector<std::pair<std::string, double>> sorted = parts;
  std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::ostringstream out;
  out << format_bytes(total());
  size_t shown = 0;
  for (const auto& [name, bytes] : sorted) {
    if (bytes <= 0 || shown == 3) break;
    out << (shown == 0 ? " (" : ", ") << name << " " << format_bytes(bytes);
    ++shown;
  }
  if (shown > 0) out << ")";
  return out.str();
}

double layer_parameter_elements(const CpPlan& plan, const LayerShape& s) {
  const PlanDims& d = plan.dims();
  const double H = static_cast<double>(plan.local_heads()), hidden = static_cast<double>(s.hidden);
  double p = static_cast<double>(d.q_rank) * H * static_cast<double>(d.qk_dim());  // q_b_proj (or q_proj)
  if (s.q_latent) p += hidden * static_cast<double>(d.q_rank);                      // q_a_proj
  p += hidden * static_cast<double>(d.kv_rank + d.rope_dim);                         // kv_a_proj_with_mqa
  p += static_cast<double>(d.kv_rank) * H * static_cast<double>(d.nope_dim + d.value_dim);  // kv_b_proj
  p += H * static_cast<double>(d.value_dim) * hidden;                                // o_proj
  if (s.output_gate) p += hidden * H * static_cast<double>(d.value_dim);             // o_gate_proj
  return p;
}

MemoryEstimate layer_memory(const CpPlan& plan, const LayerShape& s) {
  const PlanDims& d = plan.dims();
  const double e = static_cast<double>(s.element_bytes);
  const double ea = static_cast<double>(s.attention_bytes > 0 ? s.attention_bytes : s.element_bytes);
  const double ep = static_cast<double>(s.activation_bytes > 0 ? s.activation_bytes : s.element_bytes);
  const double P = static_cast<double>(plan.cp()), U = static_cast<double>(plan.ulysses());
  const double H = static_cast<double>(plan.local_heads()), Hc = static_cast<double>(plan.head_block_size());
  const double S = static_cast<double>(s.seq_len), b = static_cast<double>(s.batch);
  const double hidden = static_cast<double>(s.hidden);
  const double Dqk = static_cast<double>(d.qk_dim()), Dn = static_cast<double>(d.nope_dim);
  const double Dv = static_cast<double>(d.value_dim), Dr = static_cast<double>(d.rope_dim);
  const double Rq = static_cast<double>(d.q_rank), Rkv = static_cast<double>(d.kv_rank);
  const double T = b * S / P;  // this rank's tokens
  const double Tq = T * U;     // query rows after the Ulysses exchange (Hc heads each)
  const double Tk = b * S;     // key rows every rank attends to (Hc heads each)

  MemoryEstimate m;
  const double params = layer_parameter_elements(plan, s) * e;
  m.add("parameters", params * (s.backward ? 2.0 : 1.0));  // + their gradients

  // Activations of the projections (what the backward keeps), this rank's tokens: the module's input
  // and output at the parameters' width (under autocast q_a_proj and kv_a_proj each keep a bf16 copy
  // of the input: together its width again), the rest at ep.
  const double input = T * hidden * 2 * e;                   // input, output
  double act = 0;
  if (s.q_latent) act += T * Rq * 2;                         // q latent (the norm's input), normed
  // The local queries: nothing keeps them past the exchange (RoPE keeps its table, q_b_proj its
  // input; the exchanged Q, counted below, is the same tensor at U = 1), but while they are made
  // q_b_proj's output and the rotated Q live at once: one copy, for the forward's transient; the
  // expanded strategy sends Q packed with K and V, a second copy while the exchange runs.
  act += T * H * Dqk * (plan.strategy() == CpStrategy::latent_kv_head ? 1.0 : 2.0);
  // kv_a_proj's output [kv latent | key rope] (the kv norm keeps its input only and recomputes the
  // rest: RmsNormImpl::forward); the expanded strategy's local kv_b_proj keeps the normed latent.
  act += T * (Rkv + Dr) + (plan.strategy() == CpStrategy::latent_kv_head ? 0.0 : T * Rkv);
  act += T * H * Dv * 2;                                     // attention output (head and sequence layouts)
  if (s.output_gate) act += T * H * 2;
  // What the exchange brings in: queries of Hc heads for U shards, K/V of Hc heads over S.
  double exchanged = Tq * Hc * Dqk + Tq * Hc * (Dv + 1);  // Q, O and its log-sum-exp
  // kv_recompute: K/V of one sub-block of heads at a time, never kept (CpPlan::kv_recompute_heads).
  const double Hkv = plan.kv_recompute() ? static_cast<double>(plan.kv_recompute_heads()) : Hc;
  if (plan.strategy() == CpStrategy::latent_kv_head)
    exchanged += Tk * (Rkv + Dr) * 2 + Tk * Hkv * (Dn + Dv) + Tk * Hkv * (Dqk + Dv);  // latent, up-projected, K/V
  else
    exchanged += T * H * (Dqk + Dv) + Tk * Hc * (Dqk + Dv);  // local K/V, gathered K/V
  // Saved for the backward, once: the gradients the backward makes replace the activations it frees
  // as it goes (measured: a forward + backward peaks 1.03-1.17x this sum with the kernel's buffers).
  m.add("activations", input + act * ep + exchanged * ea);

  // The local kernel's working set.
  if (plan.kernel() == AttentionKernel::reference) {
    // Sq x Sk per head: the forward saves the softmax's output and the masked probabilities, beside
    // one transient (the scores); the backward holds three at once (a saved one and the gradients
    // that replace the others); the masks a byte.
    const double pairs = Tq * Hc * S;
    m.add("S x S scores (reference kernel)", pairs * (e * (s.backward ? 3.0 : 2.0) + 1.0));
  } else {
    double kernel = Tk * Hkv * (Dqk + Dv) * ea * (s.backward ? 2.0 : 1.0);  // head-major K/V (+ dK/dV)
    if (s.backward) {
      // The backward's query-block groups (blockwise_attention.cpp): G = ceil(2·threads / (B·heads)),
      // at most the query blocks; G > 1 sums dK/dV through G accumulator-width partials and their sum.
      const double blocks = std::max(1.0, std::ceil(Tq / b / 128.0));
      const double groups = std::min(blocks, std::max(1.0, std::ceil(2.0 * static_cast<double>(s.threads) / (b * Hkv))));
      if (groups > 1) kernel += Tk * Hkv * (Dqk + Dv) * (e >= 8 ? 8.0 : 4.0) * (groups + 1.0);
    }
    m.add("kernel buffers", kernel);
  }
  return m;
}

void check_memory(const std::string& what, const MemoryEstimate& per_rank, int64_t ranks_on_host,
                  const MemoryLimit& limit) {
  if (!limit.enforced) return;
  const double need = per_rank.total() * static_cast<double>(std::max<int64_t>(1, ranks_on_host));
  if (need <= limit.bytes) return;
  std::ostringstream estimate;
  estimate << per_rank.to_text();
  if (ranks_on_host > 1) estimate << " per rank x " << ranks_on_host << " ranks on this host = " << format_bytes(need);
  fail(what, "the run's memory estimate exceeds the limit (checked before allocating anything)",
       {got("estimate", estimate.str()), got("limit", format_bytes(limit.bytes) + " (" + limit.source + ")")},
       "reduce --seq, --batch or the model, spread the run over more ranks or hosts, or set the limit with "
       "--memory-limit GIB (--memory-limit off skips this check)");
}

}  // namespace mlacp
