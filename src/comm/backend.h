// c10d types as mlacp's comm layer uses them (private to src/comm). LibTorch 1.13's Gloo group
// derives from c10d::ProcessGroup; 2.x's from c10d::Backend with the same collective signatures.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include "core/timeline.h"
#include "mlacp/comm.h"

namespace mlacp {

#if TORCH_VERSION_MAJOR >= 2
using C10dBackend = c10d::Backend;
#else
using C10dBackend = c10d::ProcessGroup;
#endif

// The backend of a process group for one device type (1.13: the group is its own backend).
inline c10::intrusive_ptr<C10dBackend> backend_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                  c10::DeviceType device) {
#if TORCH_VERSION_MAJOR >= 2
  return group->getBackend(device);
#else
  (void)device;
  return group;
#endif
}

struct CommGroup::Impl {
  c10::intrusive_ptr<C10dBackend> backend;  // null for a group of size 1
  int64_t rank = 0;
  int64_t size = 1;
  std::string name;
  std::shared_ptr<CommCounters> counters;
  std::shared_ptr<LinkModel> link;
  std::shared_ptr<Timeline> timeline;
  std::chrono::milliseconds timeout{0};  // the backend's collective timeout (for fault messages)
  // device: the default; group construction sets the rank's device
  c10::Device device{c10::DeviceType::CPU};  // where the group's tensors (and its control values) live
  std::string backend_name = "none";
  // Who the members are, for fault messages naming the host a rank lost: their world ranks, this
  // rank's, and where every rank runs (empty for groups over c10d groups made elsewhere).
  std::vector<int64_t> members;
  int64_t world_rank = 0;
  std::shared_ptr<const Topology> topology;
  std::mutex once_mutex;
  std::set<std::string> once;  // CommGroup::first_time keys already asked
};

}  // namespace mlacp
