// mlacp: the command-line tool. Dispatches to one subcommand; library errors become a one-line
// message and exit status 2, failed checks exit status 1.
#include <iostream>
#include <thread>

#include <ATen/Parallel.h>

#include "commands.h"
#include "mlacp/errors.h"

namespace mlacp::tools {

void apply_threads(const CommonArgs& common) {
  const int threads = common.threads > 0 ? common.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
}

}  // namespace mlacp::tools

int main(int argc, char** argv) {
  using namespace mlacp::tools;
  CLI::App app{"mlacp: exact Multi-head Latent Attention with context parallelism, on LibTorch"};
  app.require_subcommand(1);
  CommonArgs common;
  app.add_option("--threads", common.threads, "intra-op threads per process (0 = all cores)")->check(CLI::NonNegativeNumber);
  InfoArgs info;
  VerifyArgs verify;
  CLI::App* info_cmd = add_info_command(app, info);
  CLI::App* verify_cmd = add_verify_command(app, verify);
  CLI11_PARSE(app, argc, argv);
  try {
    if (info_cmd->parsed()) return run_info(common, info);
    if (verify_cmd->parsed()) return run_verify(common, verify);
  } catch (const mlacp::Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "mlacp: internal error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
