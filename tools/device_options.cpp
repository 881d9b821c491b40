#include "device_options.h"

#include <cstdlib>
#include <iostream>

#include <torch/version.h>

#include "commands.h"
#include "core/device.h"
#include "mlacp/errors.h"
#include "option_checks.h"

namespace mlacp::tools {

void add_device_options(CLI::App* cmd, DeviceArgs& args) {
  cmd->add_option("--device", args.device,
                  "cpu | cuda: where each rank's tensors live (cuda: the GPU LOCAL_RANK of the visible ones)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--backend", args.backend,
                  "auto | gloo | nccl: the collectives' backend (auto: gloo on cpu, nccl on cuda; gloo on cuda runs "
                  "several ranks on one GPU)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}))
      ->capture_default_str();
}

void add_timeout_option(CLI::App* cmd, int& seconds, const std::string& help) {
  cmd->add_option("--timeout", seconds, help)->check(int_range(1, 3600))->capture_default_str();
}

void check_device_args(const DeviceArgs& args, int64_t local_ranks, const std::string& command) {
  const CommBackend backend = parse_comm_backend(args.backend);
  if (!args.cuda()) {
    check_group_options(group_options_for(args, c10::Device(c10::DeviceType::CPU), 1));  // the groups' own rules
    return;
  }
  const int64_t gpus = device_count(c10::DeviceType::CUDA);
  MLACP_REQUIRE(gpus > 0, command, "--device cuda needs a visible CUDA GPU and a LibTorch built with CUDA",
                {got("visible_gpus", gpus), got("libtorch", TORCH_VERSION),
                 got("CUDA_VISIBLE_DEVICES", std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES")
                                                                                   : "(unset)")},
                "run on a GPU machine with the PyTorch 2.x wheel's LibTorch (MLACP_LIBTORCH=wheel scripts/build.sh), "
                "or use --device cpu");
  MLACP_REQUIRE(backend == CommBackend::gloo || local_ranks <= gpus, command,
                "NCCL needs a GPU per rank: it refuses two ranks on one GPU",
                {got("local_ranks", local_ranks), got("visible_gpus", gpus), got("backend", args.backend)},
                "run at most one rank per GPU, or pass --backend gloo (Gloo's CUDA path stages through host memory)");
  check_group_options(group_options_for(args, c10::Device(c10::DeviceType::CUDA, 0), 1));  // the groups' own rules
}

c10::Device rank_device(const DeviceArgs& args, const WorldInfo& world) {
  if (!args.cuda()) return c10::Device(c10::DeviceType::CPU);
  const int64_t gpus = device_count(c10::DeviceType::CUDA);
  MLACP_REQUIRE(gpus > 0, "device", "--device cuda needs a visible CUDA GPU", {got("visible_gpus", gpus)},
                "run on a GPU machine, or use --device cpu");
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(world.local_rank % gpus));
  set_current_device(device);
  return device;
}

int64_t local_world_size(const WorldInfo& world) {
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE")) {
    char* end = nullptr;
    const long long n = std::strtoll(local, &end, 10);
    if (end != local && *end == '\0' && n >= 1) return n;
  }
  return world.local_rank + 1;
}

GroupOptions group_options_for(const DeviceArgs& args, const c10::Device& device, int timeout_s) {
  GroupOptions options;
  options.timeout = std::chrono::seconds(timeout_s);
  options.device = device;
  options.backend = parse_comm_backend(args.backend);
  // A peer that dies while the groups connect: this rank ends within --timeout with the fault,
  // instead of waiting one timeout per group (comm.h).
  options.on_group_timeout = [](const std::string& message) {
    std::cerr << message << std::endl;
    std::_Exit(kExitFault);
  };
  return options;
}

}  // namespace mlacp::tools
