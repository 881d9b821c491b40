// The local launcher: fork+exec one process per rank, pump their pipes line by line, fail fast.
// See launcher.h for the contract.
#include "launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <system_error>
#include <utility>

#include "mlacp/errors.h"
#include "temp_files.h"

extern char** environ;

namespace mlacp::tools {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPollMs = 100;                         // no busy-spin: the loop wakes at least this often
constexpr std::chrono::milliseconds kDrain{1000};    // after the last rank exits, wait this long for EOF
constexpr size_t kMaxLine = 1 << 20;                 // a longer line without '\n' is emitted in pieces

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), "mlacp launch: " + what);
}

struct Stream {  // one pipe from a rank, not yet cut into lines
  int fd = -1;
  std::string pending;
};

struct Rank {
  int index = 0;
  pid_t pid = -1;  // also its process group id
  Stream out, err;
  std::string last_error;  // last error line on stderr (is_error_line)
  bool running = false;
  int status = 0;  // waitpid status once it has exited
};

struct Sinks {
  std::ostream& out;
  std::ostream& err;
};

// ---- signals -----------------------------------------------------------------------------------

volatile sig_atomic_t g_signal = 0;        // the last SIGINT/SIGTERM the launcher received
volatile sig_atomic_t g_signal_count = 0;  // how many it received
extern "C" void on_signal(int sig) {
  g_signal = sig;
  g_signal_count = g_signal_count + 1;
}

// While alive: SIGINT/SIGTERM are recorded for forwarding, SIGCHLD is default (so we can reap).
class SignalScope {
 public:
  SignalScope() {
    g_signal = 0;
    g_signal_count = 0;
    for (int i = 0; i < 3; ++i) {
      struct sigaction sa {};
      sa.sa_handler = kSignals[i] == SIGCHLD ? SIG_DFL : on_signal;  // no SA_RESTART: poll() wakes up
      sigemptyset(&sa.sa_mask);
      sigaction(kSignals[i], &sa, &old_[i]);
    }
  }
  ~SignalScope() {
    for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  static constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGCHLD};
  struct sigaction old_[3] {};
};

std::string signal_name(int sig) {
  static const std::pair<int, const char*> names[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"}};
  for (const auto& [number, name] : names)
    if (number == sig) return name;
  return std::to_string(sig);
}

int exit_code(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

std::string describe(int status) {
  return WIFSIGNALED(status) ? "signal " + signal_name(WTERMSIG(status)) : "exit code " + std::to_string(WEXITSTATUS(status));
}

// Sends `sig` to the process group of every running rank.
void signal_running(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks)
    if (r.running && kill(-r.pid, sig) != 0) kill(r.pid, sig);
}

// ---- starting ranks ----------------------------------------------------------------------------

std::vector<std::string> rank_environment(const LaunchOptions& options, int rank, int port,
                                          const std::string& store_file) {
  const std::vector<std::pair<std::string, std::string>> ours = {
      {"RANK", std::to_string(rank)},          {"WORLD_SIZE", std::to_string(options.nproc)},
      {"LOCAL_RANK", std::to_string(rank)},    {"LOCAL_WORLD_SIZE", std::to_string(options.nproc)},
      {"MASTER_ADDR", options.master_addr},    {"MASTER_PORT", std::to_string(port)},
      {"MLACP_RENDEZVOUS_FILE", store_file},   {"MLACP_LAUNCHED", "1"}};
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (std::none_of(ours.begin(), ours.end(), [&](const auto& kv) { return kv.first == name; })) env.push_back(entry);
  }
  for (const auto& [name, value] : ours) env.push_back(name + "=" + value);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (auto& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// In the forked child: async-signal-safe calls only, then exec.
[[noreturn]] void exec_child(const char* path, char* const* argv, char* const* envp, int stdin_fd, int out_fd,
                             int err_fd, pid_t parent) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(126);  // the launcher died before prctl
  // Signals arrive blocked; reset the inherited handlers first, so a SIGTERM sent now is not swallowed.
  for (int sig : {SIGINT, SIGTERM, SIGPIPE}) signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (dup2(stdin_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) _exit(126);
  for (int fd = 0; fd < 3; ++fd) fcntl(fd, F_SETFD, 0);
#ifdef SYS_close_range
  syscall(SYS_close_range, 3U, ~0U, 0U);  // fds the parent program left inheritable
#endif
  execve(path, argv, envp);
  const int code = errno == ENOENT ? 127 : 126;
  const char* parts[] = {"mlacp launch: cannot execute ", path, code == 127 ? ": not found\n" : ": exec failed\n"};
  for (const char* p : parts) (void)!write(2, p, strlen(p));
  _exit(code);
}

void spawn(Rank& rank, const std::string& path, char* const* argv, char* const* envp, int stdin_fd) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) throw_errno("pipe");
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(out_pipe[0]);
    close(out_pipe[1]);
    throw_errno("pipe");
  }
  const pid_t parent = getpid();
  sigset_t all, old_mask;  // signals stay blocked in the child until it has reset their handlers
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old_mask);
  const pid_t pid = fork();
  if (pid == 0) exec_child(path.c_str(), argv, envp, stdin_fd, out_pipe[1], err_pipe[1], parent);
  const int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (pid < 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    errno = fork_errno;
    throw_errno("fork");
  }
  setpgid(pid, pid);  // also done by the child; whichever runs first wins the race
  rank.pid = pid;
  rank.running = true;
  rank.out.fd = out_pipe[0];
  rank.err.fd = err_pipe[0];
  fcntl(rank.out.fd, F_SETFL, O_NONBLOCK);
  fcntl(rank.err.fd, F_SETFL, O_NONBLOCK);
}

void start_ranks(std::vector<Rank>& ranks, const LaunchOptions& options, const std::vector<std::string>& args,
                 int port, const std::string& store_file) {
  const std::string path = options.executable.empty() ? "/proc/self/exe" : options.executable;
  std::string argv0 = path;
  if (options.executable.empty()) {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n > 0) argv0.assign(buf, static_cast<size_t>(n));
  }
  std::vector<std::string> argv_strings{argv0};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv = c_strings(argv_strings);
  const int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw_errno("open /dev/null");
  try {
    for (int i = 0; i < options.nproc; ++i) {
      std::vector<std::string> env = rank_environment(options, i, port, store_file);
      std::vector<char*> envp = c_strings(env);
      ranks[i].index = i;
      spawn(ranks[i], path, argv.data(), envp.data(), devnull);
    }
  } catch (...) {
    close(devnull);
    throw;
  }
  close(devnull);
}

// ---- output ------------------------------------------------------------------------------------

// Whether a rank's stderr line reports an error, the one the launcher quotes when the rank fails:
// mlacp's own ("mlacp: ...", "mlacp launch: ..."), or one that says error or fatal (a sanitizer's
// report, the C++ runtime's "terminate called ..."). A progress or info line ("train: resumed
// from ...") is none: a rank killed after printing one has no last error.
bool is_error_line(const std::string& line) {
  if (line.rfind("mlacp", 0) == 0 || line.rfind("terminate called", 0) == 0) return true;
  std::string lower = line;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find("error") != std::string::npos || lower.find("fatal") != std::string::npos;
}

void emit(Rank& rank, bool is_err, const std::string& line, Sinks& sinks) {
  if (is_err && is_error_line(line)) rank.last_error = line;
  std::ostream& sink = is_err ? sinks.err : sinks.out;
  if (is_err || rank.index != 0) sink << "[rank " << rank.index << "] ";
  sink << line << '\n';
}

// One read from a ready pipe; emits its complete lines, and at EOF the partial last one.
void read_once(Rank& rank, bool is_err, Sinks& sinks) {
  Stream& s = is_err ? rank.err : rank.out;
  char buf[65536];
  const ssize_t n = read(s.fd, buf, sizeof buf);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n > 0) {
    s.pending.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = s.pending.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(rank, is_err, s.pending.substr(start, nl - start), sinks);
    s.pending.erase(0, start);
    if (s.pending.size() < kMaxLine) return;
  }
  if (!s.pending.empty()) emit(rank, is_err, s.pending, sinks);
  s.pending.clear();
  if (n <= 0) {  // EOF or a read error: this pipe is done
    close(s.fd);
    s.fd = -1;
  }
}

// Waits up to `timeout_ms` for output on any open pipe and forwards what arrived.
void pump(std::vector<Rank>& ranks, Sinks& sinks, int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, bool>> owners;
  for (Rank& r : ranks)
    for (bool is_err : {false, true})
      if (const int fd = (is_err ? r.err : r.out).fd; fd >= 0) {
        fds.push_back({fd, POLLIN, 0});
        owners.emplace_back(&r, is_err);
      }
  if (fds.empty()) timeout_ms = std::min(timeout_ms, 10);  // only exits left to notice: look often
  if (poll(fds.data(), fds.size(), timeout_ms) <= 0) return;  // timeout, or EINTR from a signal
  for (size_t i = 0; i < fds.size(); ++i)
    if (fds[i].revents != 0) read_once(*owners[i].first, owners[i].second, sinks);
  sinks.out.flush();
  sinks.err.flush();
}

void close_pipes(std::vector<Rank>& ranks) {
  for (Rank& r : ranks)
    for (Stream* s : {&r.out, &r.err})
      if (s->fd >= 0) close(std::exchange(s->fd, -1));
}

// ---- supervising -------------------------------------------------------------------------------

// Reaps ranks that exited; first SIGKILLs what is left of their process group (no orphans).
std::vector<Rank*> reap_exited(std::vector<Rank>& ranks) {
  std::vector<Rank*> exited;
  for (Rank& r : ranks) {
    if (!r.running) continue;
    siginfo_t info{};
    const int rc = waitid(P_PID, r.pid, &info, WEXITED | WNOHANG | WNOWAIT);
    if ((rc == 0 && info.si_pid == 0) || (rc != 0 && errno == EINTR)) continue;  // still running
    kill(-r.pid, SIGKILL);  // the rank is a zombie, so its pid (= group id) cannot be reused yet
    int reaped;
    while ((reaped = waitpid(r.pid, &r.status, 0)) < 0 && errno == EINTR) {
    }
    if (reaped < 0) r.status = W_EXITCODE(255, 0);  // reaped by someone else: exit status unknown
    r.running = false;
    exited.push_back(&r);
  }
  return exited;
}

struct Outcome {
  Rank* failed = nullptr;   // the first rank that failed
  Rank* stopped = nullptr;  // a rank found stopped (SIGSTOP, a debugger) when that happened
  int signal = 0;           // the signal that interrupted the launcher, when none failed first
};

// Whether a running rank is stopped (process state T or t in /proc/PID/stat): its peers then
// time out waiting for it, and it, not they, is the cause.
bool is_stopped(const Rank& r) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(r.pid) + "/stat").c_str(), "r");
  if (!f) return false;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const char* close = std::strrchr(buf, ')');  // the state follows "(comm) "
  return n > 0 && close && (close[2] == 'T' || close[2] == 't');
}

Outcome supervise(std::vector<Rank>& ranks, std::chrono::milliseconds grace, Sinks& sinks) {
  Outcome outcome;
  bool stopping = false;
  auto kill_at = Clock::time_point::max();
  auto drain_until = Clock::time_point::max();
  int signals_seen = 0;
  const auto stop = [&](int sig) {
    stopping = true;
    kill_at = Clock::now() + grace;
    signal_running(ranks, sig);
  };
  for (;;) {
    pump(ranks, sinks, kPollMs);
    for (Rank* r : reap_exited(ranks))
      if (!stopping && r->status != 0) {
        outcome.failed = r;
        for (Rank& other : ranks)
          if (other.running && is_stopped(other)) outcome.stopped = &other;
        stop(SIGTERM);
      }
    if (g_signal_count != signals_seen) {
      signals_seen = g_signal_count;
      if (!stopping) {
        outcome.signal = g_signal;
        stop(g_signal);
      } else {
        kill_at = Clock::now();  // a second signal: no more grace
      }
    }
    const auto now = Clock::now();
    if (now >= kill_at) {
      signal_running(ranks, SIGKILL);
      kill_at = Clock::time_point::max();
    }
    if (std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.running; })) continue;
    if (drain_until == Clock::time_point::max()) drain_until = now + kDrain;
    const bool open = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.out.fd >= 0 || r.err.fd >= 0; });
    if (!open || now >= drain_until) break;
  }
  close_pipes(ranks);
  return outcome;
}

}  // namespace

RendezvousFolder::RendezvousFolder() {
  std::string pattern = owned_temp_path("rendezvous") + "-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw_errno("create the rendezvous folder " + pattern);
  path_ = pattern;
}

RendezvousFolder::~RendezvousFolder() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

int pick_free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    throw_errno("pick a free port");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

int launch_local(const LaunchOptions& options, const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  MLACP_REQUIRE(options.nproc >= 1, "launch", "--nproc must be at least 1", {got("nproc", options.nproc)},
                "pass --nproc 1 or more");
  MLACP_REQUIRE(options.master_port >= 0 && options.master_port <= 65535, "launch",
                "the master port must be in [0, 65535]", {got("master_port", options.master_port)},
                "use 0 to pick a free port");
  const int port = options.master_port > 0 ? options.master_port : pick_free_port();
  remove_stale_temp_files();  // what launches killed by SIGKILL left (temp_files.h)
  // The ranks meet over a FileStore in a folder only this user can enter: no rendezvous port
  // listens on any interface (Gloo's own connections bind 127.0.0.1). Removed when the ranks end.
  const RendezvousFolder folder;
  SignalScope signals;
  std::vector<Rank> ranks(static_cast<size_t>(options.nproc));
  try {
    start_ranks(ranks, options, args, port, folder.store_file());
  } catch (...) {
    signal_running(ranks, SIGKILL);
    for (Rank& r : ranks)
      if (r.running) waitpid(r.pid, &r.status, 0);
    close_pipes(ranks);
    throw;
  }
  Sinks sinks{out, err};
  const Outcome outcome = supervise(ranks, std::max(options.grace, std::chrono::milliseconds(0)), sinks);
  if (outcome.failed != nullptr && outcome.stopped != nullptr) {
    const Rank& r = *outcome.failed;
    err << "mlacp launch: rank " << outcome.stopped->index
        << " is stopped (process state T: SIGSTOP or a debugger) and did not answer; rank " << r.index
        << " failed waiting for it (" << describe(r.status)
        << "); its error: " << (r.last_error.empty() ? "(none)" : r.last_error) << std::endl;
    return exit_code(r.status);
  }
  if (outcome.failed != nullptr) {
    const Rank& r = *outcome.failed;
    err << "mlacp launch: rank " << r.index << " failed (" << describe(r.status) << "); last error: "
        << (r.last_error.empty() ? "(none: it printed no error line)" : r.last_error) << std::endl;
    return exit_code(r.status);
  }
  if (outcome.signal != 0) {
    err << "mlacp launch: interrupted by " << signal_name(outcome.signal) << "; stopped all ranks" << std::endl;
    return 128 + outcome.signal;
  }
  return 0;
}

int launch_local(const LaunchOptions& options, const std::vector<std::string>& args) {
  return launch_local(options, args, std::cout, std::cerr);
}

}  // namespace mlacp::tools
