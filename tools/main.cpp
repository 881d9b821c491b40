// mlacp: the command-line tool. Dispatches to one subcommand; library errors become a one-line
// message and exit status 2, failed checks exit status 1.
#include <sched.h>

#include <cstdlib>
#include <iostream>
#include <cmath>
#include <cerrno>
#include <regex>
#include <thread>

#include <ATen/Parallel.h>

#include "commands.h"
#include "kernel_bench.h"
#include "launcher.h"
#include "memory_check.h"
#include "option_checks.h"
#include "plan_command.h"
#include "train_command.h"
#include "mlacp/errors.h"
#include "core/host_allocator.h"
#include "kernels/float32_gemm.h"
#include "core/threads.h"

namespace mlacp::tools {

mlacp::HostAllocatorPolicy& host_allocator_policy() {
  static mlacp::HostAllocatorPolicy policy;
  return policy;
}

bool launched_as_rank() { return std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr; }

int rank_threads(const CommonArgs& common, int64_t ranks_here) {
  if (common.threads > 0) return common.threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / static_cast<int>(std::max<int64_t>(1, ranks_here)));
}

void apply_threads(const CommonArgs& common) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int threads = rank_threads(common, local ? std::max(1, std::atoi(local)) : 1);
  set_intra_op_threads(threads);
  if (common.batch_scheduling && !mlacp::use_batch_scheduling())
    std::cerr << "mlacp: --batch-sched: the scheduler refused SCHED_BATCH; running under the default policy\n";
  if (common.pin_cores) {
    // Local rank r gets cores [r * threads, (r + 1) * threads) modulo the host's cores; threads
    // started later (the backend's) inherit the mask.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const char* local = std::getenv("LOCAL_RANK");
    const int local_rank = local ? std::atoi(local) : 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int t = 0; t < threads; ++t) CPU_SET((local_rank * threads + t) % cores, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0)
      std::cerr << "mlacp: --pin-cores: could not set the CPU affinity of local rank " << local_rank << "\n";
  }
}

int relaunch_local(const CommonArgs& common, int nproc) {
  std::vector<std::string> args;
  for (size_t i = 1; i < common.argv.size(); ++i) {
    const std::string& a = common.argv[i];
    if (a == "--nproc") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    args.push_back(a);
  }
  LaunchOptions options;
  options.nproc = nproc;
  return launch_local(options, args);
}

}  // namespace mlacp::tools

namespace {

// An argument that is written as a number but does not fit int64 (integers) or a finite double.
bool out_of_range_number(const std::string& arg) {
  static const std::regex integer(R"([+-]?[0-9]+)"), decimal(R"([+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)");
  if (std::regex_match(arg, integer)) {
    errno = 0;
    (void)std::strtoll(arg.c_str(), nullptr, 10);
    return errno == ERANGE;
  }
  if (std::regex_match(arg, decimal)) {
    errno = 0;
    const double v = std::strtod(arg.c_str(), nullptr);
    return errno == ERANGE && !std::isfinite(v);
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace mlacp::tools;
  // Before the first tensor: freed activations are reused instead of page-faulted in each step.
  host_allocator_policy() = mlacp::keep_freed_host_memory();
  CLI::App app{"mlacp: exact Multi-head Latent Attention with context parallelism, on LibTorch"};
  app.require_subcommand(1);
  CommonArgs common;
  common.argv.assign(argv, argv + argc);
  app.add_option("--threads", common.threads, "intra-op threads per process (0 = cores / local ranks)")
      ->check(int_range(0, 1024));
  app.add_flag("--pin-cores", common.pin_cores, "pin each local rank to its own cores (steadier benchmarks)");
  app.add_flag("--batch-sched", common.batch_scheduling,
               "run ranks under SCHED_BATCH: backend threads do not preempt computation (CPU hosts)");
  add_memory_limit_option(app, common.memory_limit);
  app.add_option("--iface", common.iface,
                 "network interface(s) the ranks' Gloo groups bind under torchrun, as GLOO_SOCKET_IFNAME (and NCCL's "
                 "NCCL_SOCKET_IFNAME unless set); default: the interface on the route to MASTER_ADDR")
      ->check(network_interfaces());
  InfoArgs info;
  VerifyArgs verify;
  BenchArgs bench;
  CLI::App* info_cmd = add_info_command(app, info);
  CLI::App* verify_cmd = add_verify_command(app, verify);
  CLI::App* bench_cmd = add_bench_command(app, bench);
  KernelBenchArgs kernel_bench;
  CLI::App* kernel_bench_cmd = add_kernel_bench_command(app, kernel_bench);
  TrainArgs train;
  CLI::App* train_cmd = add_train_command(app, train);
  PlanArgs plan;
  CLI::App* plan_cmd = add_plan_command(app, plan);
  // Values no option accepts, which CLI11 would take silently: an empty value (it leaves the
  // default in place) and a number beyond int64/double (CLI11 clamps it to the largest value).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string option = i > 1 && argv[i - 1][0] == '-' ? std::string(argv[i - 1]) : std::string("an option");
    if (arg.empty() || arg.find_first_not_of(" \t") == std::string::npos) {
      std::cerr << "mlacp: invalid command line: " << option
                << " was given an empty value; got an empty argument at position " << i
                << "; give the value or drop the option (mlacp <command> --help lists the options)\n";
      return kExitInvalidInput;
    }
    if (out_of_range_number(arg)) {
      std::cerr << "mlacp: invalid command line: " << option << " " << arg
                << ": the number is out of range for any option (integers below 2^63, finite floats); "
                << "mlacp <command> --help lists each option's range\n";
      return kExitInvalidInput;
    }
  }
  // An unknown command is named as such (CLI11 would only say a subcommand is required).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--threads" || arg == "--memory-limit" || arg == "--iface") {
      ++i;
      continue;
    }
    if (!arg.empty() && arg[0] == '-') continue;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands({})) known = known || sub->get_name() == arg;
    if (!known) {
      std::cerr << "mlacp: unknown command '" << arg << "': the commands are info, verify, bench, bench-kernel, "
                << "train and plan (mlacp --help lists them)\n";
      return kExitInvalidInput;
    }
    break;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help
    // Command-line rule broken: one mlacp line with CLI11's own text (it names the option and value).
    std::cerr << "mlacp: invalid command line: " << e.what() << " (mlacp <command> --help lists the options)\n";
    return kExitInvalidInput;
  }
  if (!common.iface.empty()) {  // the ranks read it where torchrun's ranks read c10d's variable
    ::setenv("GLOO_SOCKET_IFNAME", common.iface.c_str(), 1);
    ::setenv("NCCL_SOCKET_IFNAME", common.iface.c_str(), 0);
  }
  try {
    mlacp::float32_gemm_setting();  // MLACP_FLOAT32_GEMM checked before any GEMM runs
    if (info_cmd->parsed()) return run_info(common, info);
    if (verify_cmd->parsed()) return run_verify(common, verify);
    if (bench_cmd->parsed()) return run_bench(common, bench);
    if (train_cmd->parsed()) return run_train(common, train);
    if (kernel_bench_cmd->parsed()) return run_kernel_bench(common, kernel_bench);
    if (plan_cmd->parsed()) return run_plan(common, plan);
  } catch (const mlacp::Error& e) {
    std::cerr << e.what() << "\n";
    return e.kind() == mlacp::ErrorKind::fault ? kExitFault : kExitInvalidInput;
  } catch (const std::bad_alloc&) {
    std::cerr << "mlacp: out of host memory: an allocation failed on this rank; reduce --seq, --batch or the model, "
                 "or run more ranks\n";
    return kExitFault;
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (what.find("CUDA out of memory") != std::string::npos) {  // LibTorch's CUDA caching allocator
      std::cerr << "mlacp: out of GPU memory: " << what.substr(0, what.find('\n'))
                << "; reduce --seq, --batch or the model, or run more ranks\n";
      return kExitFault;
    }
    if (what.find("can't allocate memory") != std::string::npos) {  // LibTorch's CPU allocator
      std::cerr << "mlacp: out of host memory: " << what.substr(0, what.find('\n'))
                << "; reduce --seq, --batch or the model, or run more ranks\n";
      return kExitFault;
    }
    std::cerr << "mlacp: internal error: " << what.substr(0, what.find('\n')) << "\n";
    return kExitInternal;
  }
  return 0;
}
