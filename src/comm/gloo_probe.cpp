#include "comm/gloo_probe.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace mlacp {

GlooProbe probe_gloo() {
  GlooProbe probe;
  const auto path = std::filesystem::temp_directory_path() / ("mlacp-gloo-probe-" + std::to_string(::getpid()));
  std::filesystem::remove(path);
  try {
    auto store = c10::make_intrusive<c10d::FileStore>(path.string(), 1);
    auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(10000));
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, options);
    std::vector<at::Tensor> tensors{at::ones({4})};
    group->allreduce(tensors)->wait();
    probe.available = tensors[0].sum().item<double>() == 4.0;
    probe.detail = probe.available ? "c10d ProcessGroupGloo, loopback all-reduce ok" : "all-reduce gave wrong data";
  } catch (const std::exception& e) {
    probe.detail = e.what();
  }
  std::filesystem::remove(path);
  return probe;
}

}  // namespace mlacp
