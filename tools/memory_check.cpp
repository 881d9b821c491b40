#include "memory_check.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "commands.h"
#include "core/host_memory.h"
#include "mlacp/errors.h"

namespace mlacp::tools {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kDefaultFraction = 0.9;

void add_memory_limit_option(CLI::App& app, std::string& value) {
  app.add_option("--memory-limit", value,
                 "host memory the run may plan to use, in GiB for all local ranks together (default: 90% of what "
                 "is available now); off: do not check the estimate")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            if (v == "off") return "";
            try {
              size_t used = 0;
              const double gib = std::stod(v, &used);
              if (used == v.size() && gib > 0 && gib < 1e9) return "";
            } catch (...) {
            }
            return "must be a number of GiB > 0 (below 1e9) or off";
          },
          "GIB|off"));
}

MemoryLimit memory_limit(const CommonArgs& common) {
  MemoryLimit limit;
  if (common.memory_limit == "off") {
    limit.enforced = false;
    limit.source = "--memory-limit off";
    return limit;
  }
  if (!common.memory_limit.empty()) {
    limit.bytes = std::stod(common.memory_limit) * kGiB;
    limit.source = "--memory-limit " + common.memory_limit;
    return limit;
  }
  const HostMemory host = available_host_memory();
  if (host.source.empty()) {  // nothing readable (not Linux?): nothing to check against
    limit.enforced = false;
    limit.source = "no /proc/meminfo";
    return limit;
  }
  limit.bytes = kDefaultFraction * host.available_bytes;
  limit.source = "90% of the " + format_bytes(host.available_bytes) + " available (" + host.source + ")";
  return limit;
}

double auto_plan_memory_per_rank(const CommonArgs& common, bool cuda, int64_t ranks_on_host) {
  if (cuda || launched_as_rank()) return 0.0;
  const MemoryLimit limit = memory_limit(common);
  return limit.enforced ? limit.bytes / static_cast<double>(std::max<int64_t>(1, ranks_on_host)) : 0.0;
}

void check_run_memory(const CommonArgs& common, const std::string& what, const MemoryEstimate& per_rank,
                      int launcher_ranks) {
  int ranks = launcher_ranks;
  if (ranks <= 0) {
    if (std::getenv("MLACP_LAUNCHED") != nullptr) return;  // its launcher checked every rank
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    ranks = local ? std::max(1, std::atoi(local)) : 1;
  }
  check_memory(what, per_rank, ranks, memory_limit(common));
}

}  // namespace mlacp::tools
