// The built-in local launcher behind `--nproc N`: starts N copies of this program on this host,
// one per rank, with torchrun's environment variables, streams their output, and fails fast.
#pragma once

#include <chrono>
#include <iosfwd>
#include <string>
#include <vector>

namespace mlacp::tools {

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                       // 0: pick a free loopback port
  std::chrono::milliseconds grace{3000};     // after a rank fails: SIGTERM the others, SIGKILL after this
  std::string executable;                    // empty: /proc/self/exe
};
// Starts `nproc` copies of the executable with `args` (argv[1..], already without --nproc), each
// with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (torchrun's
// variables) and MLACP_LAUNCHED=1. Streams their output line by line: rank 0's stdout unprefixed,
// every other line prefixed "[rank r] " (stderr lines of every rank prefixed too, written to our stderr).
// Fails fast: when a rank exits non-zero or dies by a signal, the others get SIGTERM (then SIGKILL
// after grace) and the launcher prints to stderr one line
//   "mlacp launch: rank R failed (exit code C | signal NAME); last error: <R's last error line on stderr>"
// (an error line: mlacp's own "mlacp..." lines, or one saying error or fatal; info lines are not)
// and returns that rank's exit code (128+signal for a signal). Returns 0 when all ranks exit 0.
int launch_local(const LaunchOptions& options, const std::vector<std::string>& args);
// Picks a free TCP port on 127.0.0.1 (bind to port 0, read it, close).
int pick_free_port();

// A fresh folder under $TMPDIR (or /tmp), mode 0700, for the ranks' FileStore
// (MLACP_RENDEZVOUS_FILE), named after this process (temp_files.h: a launch removes what killed
// launches left); removed with everything in it on destruction.
class RendezvousFolder {
 public:
  RendezvousFolder();
  ~RendezvousFolder();
  RendezvousFolder(const RendezvousFolder&) = delete;
  RendezvousFolder& operator=(const RendezvousFolder&) = delete;
  const std::string& path() const { return path_; }
  std::string store_file() const { return path_ + "/store"; }

 private:
  std::string path_;
};

// As above, writing the ranks' stdout lines to `out` and everything else to `err` (used by tests).
// Details of both overloads:
// - Each rank runs in its own session/process group; signals go to the whole group, so helpers a
//   rank started die with it. When a rank exits, what is left of its group is SIGKILLed, so no
//   orphans outlive the call; all children are reaped before return.
// - While running, SIGINT/SIGTERM to the launcher are forwarded to every rank (SIGKILL after grace,
//   or at once on a second signal); the call then returns 128+signal unless a rank had failed first.
//   The previous handlers are restored on return. One launch at a time per process.
// - Children get stdin from /dev/null and die with the launcher (PR_SET_PDEATHSIG).
// - A rank that cannot be executed exits 127 (not found) or 126 and is reported like any failure.
// - Before it starts the ranks, removes what launches killed by SIGKILL left under $TMPDIR
//   (remove_stale_temp_files, temp_files.h).
// - Throws mlacp::Error for bad options and std::system_error when pipes or fork fail.
int launch_local(const LaunchOptions& options, const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err);

}  // namespace mlacp::tools
