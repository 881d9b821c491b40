// Process-wide thread settings of core/threads.h. Run in a forked child: they change the
// process they run in.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include <gtest/gtest.h>

#include "core/threads.h"

namespace mlacp {
namespace {

// Runs `body` in a child process; returns its exit status (0 = every check held).
template <class Body>
int in_child(Body body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

#if defined(__linux__)
TEST(Threads, BatchSchedulingCoversRunningAndLaterThreads) {
  EXPECT_EQ(in_child([] {
              int started_before = -1;
              bool go = false;
              std::thread before([&] {
                while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE)) std::this_thread::yield();
                started_before = sched_getscheduler(0);
              });
              if (sched_getscheduler(0) != SCHED_OTHER) return 1;
              if (!use_batch_scheduling()) return 2;
              if (sched_getscheduler(0) != SCHED_BATCH) return 3;
              __atomic_store_n(&go, true, __ATOMIC_RELEASE);
              before.join();
              if (started_before != SCHED_BATCH) return 4;  // a thread that already ran
              int started_after = -1;
              std::thread after([&] { started_after = sched_getscheduler(0); });
              after.join();
              return started_after == SCHED_BATCH ? 0 : 5;  // a thread started later inherits it
            }),
            0);
}
#endif

}  // namespace
}  // namespace mlacp
