// The run's memory estimate checked against this host before anything is allocated
// (include/mlacp/memory.h; README "Memory check"). The launcher checks all its local ranks at
// once before starting them; a rank started by torchrun checks itself x LOCAL_WORLD_SIZE before
// its first collective; ranks started by mlacp's own launcher were checked by it.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "mlacp/memory.h"

namespace mlacp::tools {

struct CommonArgs;

// --memory-limit: "" (default: 90% of the memory available now), "off", or GiB (> 0).
void add_memory_limit_option(CLI::App& app, std::string& value);
MemoryLimit memory_limit(const CommonArgs& common);

// Checks `per_rank` x the ranks this process stands for on this host: `launcher_ranks` when this
// process is about to start that many local ranks (0: it is a rank itself, counted by
// LOCAL_WORLD_SIZE; a rank of mlacp's launcher skips the check, its launcher made it).
void check_run_memory(const CommonArgs& common, const std::string& what, const MemoryEstimate& per_rank,
                      int launcher_ranks);

// The memory per rank the planner of --strategy/--ulysses auto may plan with
// (AutoPlanQuery::memory_bytes_per_rank): the limit for the host's ranks together over the
// `ranks_on_host` the launcher starts, for a CPU run; 0 otherwise (under torchrun each rank would
// read its own available memory and could choose differently: the hardware file's memory stands
// there; a GPU's is the device's).
double auto_plan_memory_per_rank(const CommonArgs& common, bool cuda, int64_t ranks_on_host);

}  // namespace mlacp::tools
