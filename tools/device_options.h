// --device and --backend of the commands that run the layer (verify, bench, train): where a rank's
// tensors live and which c10d backend moves them (docs/DESIGN.md §16).
#pragma once

#include <string>

#include <CLI/CLI.hpp>
#include <c10/core/Device.h>

#include "mlacp/comm.h"

namespace mlacp::tools {

struct DeviceArgs {
  std::string device = "cpu";   // cpu | cuda
  std::string backend = "auto";  // auto | gloo | nccl
  bool cuda() const { return device == "cuda"; }
};

void add_device_options(CLI::App* cmd, DeviceArgs& args);
// --timeout SECONDS of the commands that build process groups: GroupOptions::timeout, for the
// rendezvous and every collective, an integer in [1, 3600] (0 or less would make every wait fail
// at once: Gloo's "Invalid timeout").
void add_timeout_option(CLI::App* cmd, int& seconds, const std::string& help);

// Every rule of the two options, before any rank starts (the launcher, for `local_ranks` ranks on
// this host) and again in each rank (torchrun): a CUDA device needs a LibTorch with CUDA and a
// visible GPU; NCCL needs a GPU per local rank (NCCL refuses two ranks on one GPU: --backend gloo
// runs them); NCCL moves CUDA tensors only. Throws mlacp::Error naming the rule.
void check_device_args(const DeviceArgs& args, int64_t local_ranks, const std::string& command);

// This rank's device (cuda: GPU LOCAL_RANK modulo the visible GPUs), made current for the process
// before any tensor is made.
c10::Device rank_device(const DeviceArgs& args, const WorldInfo& world);

// The ranks on this host, for a rank: LOCAL_WORLD_SIZE (torchrun and mlacp's launcher set it), else
// every rank up to this one's local rank.
int64_t local_world_size(const WorldInfo& world);

// The group options for a rank on `device`.
GroupOptions group_options_for(const DeviceArgs& args, const c10::Device& device, int timeout_s);

}  // namespace mlacp::tools
