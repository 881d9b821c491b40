// The trainer's gradient reduction (docs/DESIGN.md §7): every parameter's gradient summed over CP and DP,
// TP-replicated ones also over TP, in one bucket per group.
#include <ATen/ATen.h>

#include "core/hash.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"

namespace mlacp {

void reduce_gradients(const torch::OrderedDict<std::string, at::Tensor>& parameters, const ParallelGroups& groups,
                      const std::function<bool(const std::string&)>& skips_tp_reduction) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> all, replicated;
  std::string present;
  for (const auto& item : parameters) {
    const at::Tensor& grad = item.value().grad();
    present += grad.defined() ? '1' : '0';
    if (!grad.defined()) continue;
    all.push_back(grad);
    if (!skips_tp_reduction(item.key())) replicated.push_back(grad);
  }
  // The set of parameters with gradients must agree across ranks, or the buckets would not match.
  // On a device the comparison reads a device tensor on the host (a synchronisation inside the
  // step), so there it runs at the first reduction of a set of groups only (every rank reaches
  // its first reduction together); on the CPU it runs every time (docs/DESIGN.md §16).
  // device: a device comparison synchronises the host: once per group set
  const bool compare = groups.cp.device().is_cpu() || groups.cp.first_time("gradient pattern");
  const uint64_t hash = fnv1a64(present);
  for (const CommGroup* group : {&groups.cp, &groups.dp, &groups.tp}) {
    if (!compare) break;
    for (uint64_t other : all_gather_u64(*group, hash)) {
      MLACP_REQUIRE(other == hash, "gradient reduction", "ranks disagree on which parameters have gradients",
                    {got("group", group->name()), got("this_rank_pattern", present)},
                    "freeze the same parameters on every rank");
    }
  }
  auto reduce = [](const CommGroup& group, const std::vector<at::Tensor>& grads, const std::string& label) {
    if (group.size() == 1 || grads.empty()) return;
    std::vector<at::Tensor> flat;
    for (const auto& g : grads) {
      MLACP_REQUIRE(g.scalar_type() == grads.front().scalar_type(), "gradient reduction",
                    "all gradients must share one dtype (they travel in one bucket)",
                    {got("first", grads.front().scalar_type()), got("other", g.scalar_type())},
                    "keep parameters in one dtype (use autocast for bf16 compute)");
      flat.push_back(g.reshape(-1));
    }
    at::Tensor bucket = at::cat(flat);
    at::Tensor summed = launch_all_reduce_sum(group, bucket, label).wait_one();
    int64_t offset = 0;
    for (const auto& g : grads) {
      g.copy_(summed.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  };
  reduce(groups.cp, all, "grad_cp");
  reduce(groups.dp, all, "grad_dp");
  reduce(groups.tp, replicated, "grad_tp");
}

}  // namespace mlacp
