#include "support/multiprocess.h"
#include "core/threads.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace mlacp::test {
namespace {

// How long the other ranks may keep running after one rank failed before they are killed (they
// are usually blocked in a collective with the failed rank).
constexpr std::chrono::seconds kGraceAfterFailure{5};

std::string unique_store_path() {
  static std::atomic<uint64_t> counter{0};
  std::random_device device;
  const uint64_t salt = (static_cast<uint64_t>(device()) << 32) ^ device();
  char name[128];
  std::snprintf(name, sizeof(name), "/tmp/mlacp_test_store_%d_%llu_%llx", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(counter++), static_cast<unsigned long long>(salt));
  return name;
}

[[noreturn]] void run_child(int rank, int world_size, const std::string& path, const RankBody& body) {
  int code = 0;
  try {
    mlacp::set_intra_op_threads(1);
    body(rank, world_size, path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] exception: %s\n", rank, e.what());
    code = 1;
  } catch (...) {
    std::fprintf(stderr, "[rank %d] exception of unknown type\n", rank);
    code = 1;
  }
  if (::testing::Test::HasFailure()) {
    std::fprintf(stderr, "[rank %d] gtest expectations failed in this rank\n", rank);
    code = 1;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

}  // namespace

bool run_ranks(int world_size, const RankBody& body, std::chrono::seconds timeout) {
  if (world_size < 1) {
    ADD_FAILURE() << "run_ranks: world_size must be >= 1, got " << world_size;
    return false;
  }
  const std::string path = unique_store_path();
  ::unlink(path.c_str());
  std::fflush(stdout);  // nothing buffered may be printed twice by the children
  std::fflush(stderr);

  std::vector<pid_t> pids(world_size, -1);
  for (int rank = 0; rank < world_size; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) run_child(rank, world_size, path, body);
    if (pid < 0) {
      ADD_FAILURE() << "run_ranks: fork failed for rank " << rank << ": " << std::strerror(errno);
      for (int r = 0; r < rank; ++r) ::kill(pids[r], SIGKILL);
      for (int r = 0; r < rank; ++r) ::waitpid(pids[r], nullptr, 0);
      ::unlink(path.c_str());
      return false;
    }
    pids[rank] = pid;
  }

  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  auto kill_deadline = deadline;
  std::vector<int> status(world_size, 0);
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  bool ok = true;
  while (remaining > 0) {
    bool reaped = false;
    for (int rank = 0; rank < world_size; ++rank) {
      if (done[rank]) continue;
      const pid_t got = ::waitpid(pids[rank], &status[rank], WNOHANG);
      if (got == pids[rank] || (got < 0 && errno == ECHILD)) {
        if (got < 0) status[rank] = -1;
        done[rank] = true;
        --remaining;
        reaped = true;
        if (!(got > 0 && WIFEXITED(status[rank]) && WEXITSTATUS(status[rank]) == 0)) {
          ok = false;
          std::fprintf(stderr, "run_ranks: rank %d failed (%s)\n", rank,
                       got > 0 ? describe_status(status[rank]).c_str() : "lost");
          kill_deadline = std::min(kill_deadline, Clock::now() + kGraceAfterFailure);
        }
      }
    }
    if (remaining == 0) break;
    if (Clock::now() >= kill_deadline) {
      const bool timed_out = kill_deadline == deadline;
      for (int rank = 0; rank < world_size; ++rank) {
        if (done[rank]) continue;
        std::fprintf(stderr, "run_ranks: killing rank %d (%s)\n", rank,
                     timed_out ? "timeout" : "another rank failed");
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], &status[rank], 0);
        done[rank] = true;
      }
      if (timed_out)
        std::fprintf(stderr, "run_ranks: timed out after %lld s\n", static_cast<long long>(timeout.count()));
      ok = false;
      break;
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::unlink(path.c_str());
  return ok;
}

ParallelGroups make_groups(int rank, int world, const std::string& path, MeshShape shape, GroupOptions options) {
  WorldInfo info;
  info.rank = rank;
  info.size = world;
  info.local_rank = rank;
  ParallelGroups groups = create_parallel_groups_file(path, info, shape, options);
  // Group construction can return on one rank before its peers have finished their side of the
  // connections; a rank that then exits at once makes a peer's construction throw "Connection
  // closed by peer". A world barrier makes every rank's groups complete before any body goes on.
  barrier(groups.world);
  return groups;
}

}  // namespace mlacp::test
