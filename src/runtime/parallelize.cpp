// parallelize(): the one entry point that makes a module run with context parallelism. TP head
// sharding, the plan from the module's config and the groups' shape, the install checks (docs/DESIGN.md
// §8), then the cross-rank plan fingerprint comparison (the first collective), then the install
// of the plan's schedule.
#include <sstream>

#include <ATen/ATen.h>

#include "core/format.h"
#include "mlacp/errors.h"
#include "mlacp/runtime.h"
#include "model/mla_layer.h"
#include "runtime/cp_attention.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "CP install";

std::string hex(uint64_t value) {
  std::ostringstream out;
  out << std::hex << value;
  return out.str();
}

void check_projection(const torch::nn::Linear& linear, const char* name, int64_t dim, int64_t expected) {
  MLACP_REQUIRE(linear->weight.size(dim) == expected, kWhat, "projection shape must match the TP-local heads",
                {got(std::string(name) + ".weight.shape", shape_text(linear->weight)),
                 got(dim == 0 ? "expected rows" : "expected columns", expected)},
                "apply TP sharding first (module->shard_heads_for_tp(tp_rank, tp))");
}

void compare_fingerprints(const CommGroup& group, const char* group_name, uint64_t mine) {
  const std::vector<uint64_t> all = all_gather_u64(group, mine);
  for (size_t r = 0; r < all.size(); ++r) {
    MLACP_REQUIRE(all[r] == mine, kWhat, std::string("plan fingerprints differ across the ") + group_name + " group",
                  {got("this_rank_fingerprint", hex(mine)), got("rank", r), got("its_fingerprint", hex(all[r]))},
                  "build the plan from the same config and options on every rank");
  }
}

}  // namespace

CpPlanSpec plan_spec_for(const MlaConfig& c, const MeshShape& shape, CpStrategy strategy, CpPartition partition,
                         bool overlap) {
  CpPlanSpec spec;
  spec.dims = {c.num_heads, c.query_latent_dim(), c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim};
  spec.tp = shape.tp;
  spec.cp = shape.cp;
  spec.ulysses = shape.ulysses;
  spec.strategy = strategy;
  spec.partition = partition;
  spec.overlap = overlap;
  return spec;
}

void install_context_parallel(MlaAttention& module, const CpPlan& plan, const ParallelGroups& groups) {
  const MlaConfig& c = module->config();
  MLACP_REQUIRE(!module->is_parallel(), kWhat, "CP is already installed on this module",
                {got("installed", module->parallel_description())}, "install once; build a new module for another plan");
  const PlanDims& d = plan.dims();
  MLACP_REQUIRE(d.heads == c.num_heads && d.q_rank == c.query_latent_dim() && d.kv_rank == c.kv_lora_rank &&
                    d.nope_dim == c.qk_nope_head_dim && d.rope_dim == c.qk_rope_head_dim && d.value_dim == c.v_head_dim,
                kWhat, "plan dims must match the module's config",
                {got("plan", plan.to_json()), got("heads", c.num_heads), got("kv_lora_rank", c.kv_lora_rank)},
                "build the plan with plan_spec_for(module->config(), ...)");
  const std::pair<const CommGroup*, std::pair<const char*, int64_t>> degrees[] = {
      {&groups.tp, {"tp", plan.tp()}}, {&groups.cp, {"cp", plan.cp()}}, {&groups.ulysses, {"ulysses", plan.ulysses()}}};
  for (const auto& [group, degree] : degrees) {
    MLACP_REQUIRE(group->defined() && group->size() == degree.second, kWhat,
                  std::string("the ") + degree.first + " group size must equal the plan's degree",
                  {got(std::string(degree.first) + "_group_size", group->defined() ? group->size() : 0),
                   got(std::string("plan.") + degree.first, degree.second)},
                  "create the groups with the same MeshShape as the plan");
  }
  const int64_t h = plan.local_heads();
  check_projection(c.q_lora_rank ? module->q_b_proj : module->q_proj, c.q_lora_rank ? "q_b_proj" : "q_proj", 0,
                   h * c.qk_head_dim());
  check_projection(module->kv_b_proj, "kv_b_proj", 0, h * (c.qk_nope_head_dim + c.v_head_dim));
  check_projection(module->o_proj, "o_proj", 1, h * c.v_head_dim);
  if (c.output_gate) check_projection(module->o_gate_proj, "o_gate_proj", 0, h * c.v_head_dim);
  MLACP_REQUIRE(module->local_heads() == h, kWhat, "module heads must equal the plan's TP-local heads",
                {got("module.local_heads", module->local_heads()), got("plan.local_heads", h)},
                "apply TP sharding first (module->shard_heads_for_tp(tp_rank, tp))");
  // The groups move the module's tensors: they must live where the groups' backend expects them.
  const c10::Device device = module->o_proj->weight.device();
  for (const CommGroup* group : {&groups.cp, &groups.tp, &groups.ulysses, &groups.all_gather}) {
    if (!group->defined() || group->size() == 1) continue;
    const bool same = group->device().type() == device.type() &&
                      (!group->device().has_index() || !device.has_index() || group->device() == device);
    MLACP_REQUIRE(same, kWhat, "the process groups must move tensors on the module's device",
                  {got("group", group->name()), got("group.device", group->device()),
                   got("group.backend", group->backend_name()), got("module.device", device)},
                  "create the groups with GroupOptions::device set to the module's device (--device), or move the "
                  "module to the groups' device");
  }

  // device: kv_recompute runs the CPU blockwise kernel (a GPU's attention is the fused kernels')
  MLACP_REQUIRE(!plan.kv_recompute() || device.is_cpu(), kWhat, "kv_recompute runs the CPU blockwise kernel",
                {got("module.device", device)}, "turn kv_recompute off on this device");
  // First collectives: every rank must hold the same plan.
  compare_fingerprints(groups.cp, "CP", plan.fingerprint());
  compare_fingerprints(groups.tp, "TP", plan.fingerprint());
  MlaLayer::install_core(*module, std::make_shared<CpAttentionCore>(plan, groups, c, device.type()));
}

CpPlan parallelize(MlaAttention& module, const ParallelGroups& groups, const CpOptions& options) {
  const int64_t tp = groups.shape.tp;
  if (tp > 1 && module->tp_size() == 1) module->shard_heads_for_tp(groups.tp_rank, tp);
  MLACP_REQUIRE(module->tp_size() == tp, kWhat, "the module's TP sharding must match the groups' tp degree",
                {got("module.tp_size", module->tp_size()), got("groups.tp", tp)},
                "pass a module sharded for this TP degree, or an unsharded one (parallelize shards it)");
  CpPlanSpec spec = plan_spec_for(module->config(), groups.shape, options.strategy, options.partition, options.overlap);
  spec.kernel = options.kernel;
  spec.kv_recompute = options.kv_recompute;
  const CpPlan plan(spec);  // the plan's own rules (degrees, heads divisible by tp*U, ...)
  install_context_parallel(module, plan, groups);
  return plan;
}

}  // namespace mlacp
