// Groups over process groups made elsewhere (include/mlacp/c10d_groups.h).
#include "mlacp/c10d_groups.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/backend.h"
#include "core/timeline.h"
#include "mlacp/errors.h"

namespace mlacp {
namespace {

constexpr const char* kWhat = "process groups";

int64_t group_size(const c10::intrusive_ptr<c10d::ProcessGroup>& group) { return group ? group->getSize() : 1; }

// The collective timeout the group was created with (torch.distributed's `timeout=`), which fault
// messages quote: Gloo's options on either LibTorch, any backend's options on 2.x; 0 if unknown.
std::chrono::milliseconds backend_timeout(const c10::intrusive_ptr<C10dBackend>& backend) {
  if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(backend.get())) return gloo->getOptions()->timeout;
#if TORCH_VERSION_MAJOR >= 2
  try {
    return backend->getBackendOptions()->timeout;
  } catch (const std::exception&) {  // a backend without options
  }
#endif
  return std::chrono::milliseconds{0};
}

}  // namespace

CommGroup wrap_c10d_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const c10::Device& device,
                          const std::string& name, const Instruments& instruments) {
  auto impl = std::make_shared<CommGroup::Impl>();
  impl->name = name;
  impl->counters = instruments.counters;
  impl->link = instruments.link;
  impl->timeline = instruments.timeline;
  impl->device = device;
  if (group) {
    impl->rank = group->getRank();
    impl->size = group->getSize();
    if (impl->size > 1) {
      try {
        impl->backend = backend_of(group, device.type());
      } catch (const std::exception& e) {  // 2.x: getBackend throws for a device type it lacks
        impl->backend.reset();
      }
      if (impl->backend) {
        impl->backend_name = impl->backend->getBackendName();
        impl->timeout = backend_timeout(impl->backend);
      }
      MLACP_REQUIRE(impl->backend, kWhat, "the process group has no backend for the tensors' device",
                    {got("group", name), got("device", device)},
                    "create the group with a backend for that device (gloo for CPU tensors, nccl for CUDA)");
    }
  }
  return CommGroup(impl);
}

ParallelGroups parallel_groups_from_c10d(const c10::intrusive_ptr<c10d::ProcessGroup>& cp, int64_t ulysses,
                                         const c10::intrusive_ptr<c10d::ProcessGroup>& ulysses_group,
                                         const c10::intrusive_ptr<c10d::ProcessGroup>& all_gather_group,
                                         const c10::Device& device) {
  const int64_t p = group_size(cp);
  const int64_t u = ulysses == 0 ? p : ulysses;
  MLACP_REQUIRE(u >= 1 && p % u == 0, kWhat, "the CP group size must be divisible by the ulysses degree",
                {got("cp_group_size", p), got("ulysses", u)}, "choose ulysses dividing the CP group size");
  const bool hybrid = u > 1 && u < p;
  if (hybrid) {
    MLACP_REQUIRE(ulysses_group && all_gather_group, kWhat, "a hybrid (1 < ulysses < cp) needs both sub-groups",
                  {got("cp", p), got("ulysses", u)}, "pass the Ulysses and all-gather sub-groups of the CP group");
  }
  const int64_t u_size = hybrid ? group_size(ulysses_group) : u;
  const int64_t a_size = hybrid ? group_size(all_gather_group) : p / u;
  MLACP_REQUIRE(u_size == u && a_size == p / u, kWhat, "sub-group sizes must be U and P / U",
                {got("ulysses_group_size", u_size), got("all_gather_group_size", a_size), got("U", u), got("P", p)},
                "build the sub-groups from the CP group for this ulysses degree");
  ParallelGroups g;
  g.instruments.counters = std::make_shared<CommCounters>();
  g.instruments.link = std::make_shared<LinkModel>();
  g.instruments.timeline = std::make_shared<Timeline>();
  g.instruments.timeline->set_device(device);
  g.shape = {1, p, 1, u};
  g.cp = wrap_c10d_group(cp, device, "cp", g.instruments);
  g.cp_rank = g.cp.rank();
  g.world = g.cp;
  g.world_info.rank = g.cp_rank;
  g.world_info.size = p;
  g.world_info.local_rank = g.cp_rank;
  g.dp = wrap_c10d_group({}, device, "dp", g.instruments);
  g.tp = wrap_c10d_group({}, device, "tp", g.instruments);
  if (hybrid) {
    g.ulysses = wrap_c10d_group(ulysses_group, device, "ulysses", g.instruments);
    g.all_gather = wrap_c10d_group(all_gather_group, device, "all_gather", g.instruments);
    MLACP_REQUIRE(g.ulysses.rank() == g.cp_rank % u && g.all_gather.rank() == g.cp_rank / u, kWhat,
                  "sub-group ranks must follow the CP grid (Ulysses groups: U consecutive CP ranks)",
                  {got("cp_rank", g.cp_rank), got("ulysses_rank", g.ulysses.rank()),
                   got("all_gather_rank", g.all_gather.rank()), got("U", u)},
                  "build the Ulysses groups from CP ranks [a*U, (a+1)*U) and the all-gather groups from {u, u+U, ...}");
  } else if (u == p) {
    g.ulysses = g.cp;
    g.all_gather = wrap_c10d_group({}, device, "all_gather", g.instruments);
  } else {
    g.ulysses = wrap_c10d_group({}, device, "ulysses", g.instruments);
    g.all_gather = g.cp;
  }
  return g;
}

}  // namespace mlacp
