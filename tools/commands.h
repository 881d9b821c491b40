// The subcommands of `mlacp`. Each registers its options on the CLI11 app and runs from them.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace mlacp::tools {

struct CommonArgs {
  int threads = 0;  // 0: all cores of this host
};

struct InfoArgs {
  int64_t gemm_size = 2048;
  bool skip_gemm = false;
};
CLI::App* add_info_command(CLI::App& app, InfoArgs& args);
int run_info(const CommonArgs& common, const InfoArgs& args);

struct VerifyArgs {
  std::vector<std::string> cases;  // empty: the default matrix
  bool list = false;
  std::string json_path;
};
CLI::App* add_verify_command(CLI::App& app, VerifyArgs& args);
int run_verify(const CommonArgs& common, const VerifyArgs& args);

// Applies --threads (0 = all cores) to LibTorch's intra-op pool.
void apply_threads(const CommonArgs& common);

}  // namespace mlacp::tools
