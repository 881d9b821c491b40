// The local launcher, driven with /bin/sh scripts as ranks.
#include "launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "mlacp/errors.h"
#include "temp_files.h"

namespace mlacp::tools {
namespace {

using namespace std::chrono_literals;

struct Launch {
  int code = -1;
  std::string out, err;
  double seconds = 0;
};

Launch run_sh(int nproc, const std::string& script, std::chrono::milliseconds grace = 3000ms,
           LaunchOptions options = {}) {
  options.nproc = nproc;
  options.executable = "/bin/sh";
  options.grace = grace;
  std::ostringstream out, err;
  const auto start = std::chrono::steady_clock::now();
  Launch run;
  run.code = launch_local(options, {"-c", script}, out, err);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.out = out.str();
  run.err = err.str();
  return run;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> result;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) result.push_back(line);
  return result;
}

bool has_line(const std::string& text, const std::string& line) {
  const auto all = lines(text);
  return std::find(all.begin(), all.end(), line) != all.end();
}

// The launcher reaped everything it started: this process has no children left.
void expect_no_children() {
  errno = 0;
  EXPECT_EQ(waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
}

// `pid` is gone (or a zombie waiting for init), within a second.
bool process_gone(pid_t pid) {
  for (int i = 0; i < 100; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string content;
    if (!stat || !std::getline(stat, content)) return true;
    const auto close_paren = content.rfind(')');
    if (close_paren != std::string::npos && content.size() > close_paren + 2 && content[close_paren + 2] == 'Z') return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

std::vector<pid_t> helper_pids(const std::string& out) {
  std::vector<pid_t> pids;
  const std::regex re("helper (\\d+)$");
  for (const auto& line : lines(out))
    if (std::smatch m; std::regex_search(line, m, re)) pids.push_back(std::stoi(m[1]));
  return pids;
}

TEST(Launcher, AllRanksSucceedAndSeeTorchrunEnvironment) {
  const Launch run = run_sh(3,
                         "echo \"rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK lws=$LOCAL_WORLD_SIZE "
                         "addr=$MASTER_ADDR port=$MASTER_PORT launched=$MLACP_LAUNCHED\"; echo \"note $RANK\" >&2");
  EXPECT_EQ(run.code, 0) << run.err;
  const std::regex re("^(\\[rank (\\d)\\] )?rank=(\\d) world=3 local=(\\d) lws=3 addr=127\\.0\\.0\\.1 port=(\\d+) launched=1$");
  std::set<std::string> ports;
  std::set<int> ranks;
  for (const auto& line : lines(run.out)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, re)) << line;
    const int rank = std::stoi(m[3]);
    EXPECT_EQ(m[4], m[3]);
    if (rank == 0) EXPECT_FALSE(m[1].matched) << "rank 0's stdout is unprefixed: " << line;
    else EXPECT_EQ(std::string(m[2]), std::to_string(rank)) << line;
    ranks.insert(rank);
    ports.insert(m[5]);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  ASSERT_EQ(ports.size(), 1u) << "every rank sees the same MASTER_PORT";
  EXPECT_GT(std::stoi(*ports.begin()), 0);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(has_line(run.err, "[rank " + std::to_string(r) + "] note " + std::to_string(r))) << run.err;
  EXPECT_EQ(run.err.find("mlacp launch"), std::string::npos) << run.err;
  expect_no_children();
}

TEST(Launcher, ExplicitMasterAndOurVariablesOverrideInheritedOnes) {
  ASSERT_EQ(setenv("RANK", "99", 1), 0);
  ASSERT_EQ(setenv("MLACP_LAUNCHER_TEST_KEEP", "kept", 1), 0);
  LaunchOptions options;
  options.master_addr = "10.1.2.3";
  options.master_port = 29517;
  const Launch run = run_sh(2, "echo \"$RANK $MASTER_ADDR:$MASTER_PORT $MLACP_LAUNCHER_TEST_KEEP\"", 3000ms, options);
  unsetenv("RANK");
  unsetenv("MLACP_LAUNCHER_TEST_KEEP");
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(has_line(run.out, "0 10.1.2.3:29517 kept")) << run.out;
  EXPECT_TRUE(has_line(run.out, "[rank 1] 1 10.1.2.3:29517 kept")) << run.out;
  expect_no_children();
}

// The quoted line is the rank's last error line, not an info line printed after it.
TEST(Launcher, FailingRankStopsTheOthersAndIsNamed) {
  const Launch run = run_sh(3,
                         "if [ \"$RANK\" = 1 ]; then echo early >&2; echo 'mlacp: boom: bad shape' >&2; "
                         "echo 'train: stopping' >&2; echo >&2; exit 3; fi; sleep 30");
  EXPECT_EQ(run.code, 3);
  EXPECT_LT(run.seconds, 2.5) << "SIGTERM stops `sleep` at once; no need to wait out the grace period";
  EXPECT_TRUE(has_line(run.err, "mlacp launch: rank 1 failed (exit code 3); last error: mlacp: boom: bad shape"))
      << run.err;
  EXPECT_TRUE(has_line(run.err, "[rank 1] early")) << run.err;
  EXPECT_EQ(run.err.find("rank 0 failed"), std::string::npos) << "ranks we stopped are not failures: " << run.err;
  expect_no_children();
}

TEST(Launcher, RanksIgnoringSigtermAreKilledAfterGrace) {
  // Rank 2 fails only once the others ignore SIGTERM (else, on a loaded host, SIGTERM could reach
  // them before their trap is set and they would die at once).
  const Launch run = run_sh(3,
                            "d=/tmp/mlacp-sigterm-$PPID; mkdir -p $d; "
                            "if [ \"$RANK\" = 2 ]; then while [ ! -e $d/0 ] || [ ! -e $d/1 ]; do sleep 0.01; done; "
                            "rm -rf $d; exit 3; fi; trap '' TERM; touch $d/$RANK; sleep 30",
                            500ms);
  EXPECT_EQ(run.code, 3);
  EXPECT_GE(run.seconds, 0.45);
  EXPECT_LT(run.seconds, 10.0);
  EXPECT_TRUE(has_line(run.err, "mlacp launch: rank 2 failed (exit code 3); last error: (none: it printed no error line)"))
      << run.err;
  expect_no_children();
}

// A rank killed after an info line (a training rank's "train: ..."): no error to quote.
TEST(Launcher, RankKilledBySignalReturns128PlusSignal) {
  const Launch run = run_sh(2, "if [ \"$RANK\" = 0 ]; then echo 'train: resumed from step 3' >&2; kill -KILL $$; fi; "
                               "sleep 30");
  EXPECT_EQ(run.code, 137);
  EXPECT_LT(run.seconds, 10.0);
  EXPECT_TRUE(has_line(run.err, "mlacp launch: rank 0 failed (signal SIGKILL); last error: (none: it printed no error line)"))
      << run.err;
  expect_no_children();
}

TEST(Launcher, PartialLastLinesArePrinted) {
  const Launch run = run_sh(2, "echo full; printf \"out$RANK\"; printf \"err$RANK\" >&2");
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(has_line(run.out, "full")) << run.out;
  EXPECT_TRUE(has_line(run.out, "out0")) << run.out;
  EXPECT_TRUE(has_line(run.out, "[rank 1] full")) << run.out;
  EXPECT_TRUE(has_line(run.out, "[rank 1] out1")) << run.out;
  EXPECT_TRUE(has_line(run.err, "[rank 0] err0")) << run.err;
  EXPECT_TRUE(has_line(run.err, "[rank 1] err1")) << run.err;
  EXPECT_EQ(run.out.back(), '\n');
}

TEST(Launcher, StdinIsDevNull) {
  const Launch run = run_sh(1, "cat; echo done");
  EXPECT_EQ(run.code, 0);
  EXPECT_EQ(run.out, "done\n");
  EXPECT_LT(run.seconds, 5.0);
}

TEST(Launcher, HelpersLeftByRanksDoNotOutliveTheLaunch) {
  // Rank 0 succeeds but leaves a background helper holding its stdout; rank 1 fails with one.
  const Launch ok = run_sh(1, "sleep 30 & echo \"helper $!\"; exit 0");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_LT(ok.seconds, 5.0);
  const Launch failed = run_sh(2, "sleep 30 & echo \"helper $!\"; if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 4; fi; wait");
  EXPECT_EQ(failed.code, 4) << failed.err;
  EXPECT_LT(failed.seconds, 5.0);
  std::vector<pid_t> helpers = helper_pids(ok.out);
  for (pid_t p : helper_pids(failed.out)) helpers.push_back(p);
  ASSERT_EQ(helpers.size(), 3u) << ok.out << failed.out;
  for (pid_t p : helpers) EXPECT_TRUE(process_gone(p)) << "helper " << p << " survived";
  expect_no_children();
}

TEST(Launcher, ForwardsSigtermAndRestoresTheHandler) {
  std::thread sender([] {
    std::this_thread::sleep_for(400ms);
    kill(getpid(), SIGTERM);
  });
  const Launch run = run_sh(2, "sleep 30");
  sender.join();
  EXPECT_EQ(run.code, 128 + SIGTERM);
  EXPECT_LT(run.seconds, 5.0);
  EXPECT_TRUE(has_line(run.err, "mlacp launch: interrupted by SIGTERM; stopped all ranks")) << run.err;
  struct sigaction current {};
  sigaction(SIGTERM, nullptr, &current);
  EXPECT_EQ(current.sa_handler, SIG_DFL);
  expect_no_children();
}

TEST(Launcher, MissingExecutableIsAFailedRank) {
  LaunchOptions options;
  options.nproc = 2;
  options.executable = "/nonexistent/mlacp";
  std::ostringstream out, err;
  EXPECT_EQ(launch_local(options, {"verify"}, out, err), 127);
  EXPECT_TRUE(std::regex_search(err.str(), std::regex("mlacp launch: rank [01] failed \\(exit code 127\\); last error: "
                                                      "mlacp launch: cannot execute /nonexistent/mlacp: not found")))
      << err.str();
  expect_no_children();
}

TEST(Launcher, DefaultExecutableIsThisProgram) {
  LaunchOptions options;
  options.nproc = 2;  // executable empty: /proc/self/exe, i.e. this test binary
  std::ostringstream out, err;
  EXPECT_EQ(launch_local(options, {"--gtest_list_tests", "--gtest_filter=Launcher.DefaultExecutable*"}, out, err), 0)
      << err.str();
  EXPECT_TRUE(has_line(out.str(), "  DefaultExecutableIsThisProgram")) << out.str();
  EXPECT_TRUE(has_line(out.str(), "[rank 1]   DefaultExecutableIsThisProgram")) << out.str();
  expect_no_children();
}

// What launches killed by SIGKILL left under $TMPDIR goes at the next launch: entries named after a
// process that is gone, or after a pid that another process now has (another start time). What a
// live process owns, and names that are not the tool's, stay.
TEST(Launcher, RemovesWhatKilledLaunchesLeft) {
  namespace fs = std::filesystem;
  char pattern[] = "/tmp/mlacp-launcher-test-XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  const fs::path tmp = pattern;
  const char* saved = std::getenv("TMPDIR");
  const std::string saved_tmpdir = saved ? saved : "";
  setenv("TMPDIR", tmp.c_str(), 1);
  const pid_t gone = fork();  // a pid that no process has once reaped
  if (gone == 0) _exit(0);
  waitpid(gone, nullptr, 0);
  const fs::path killed_launch = tmp / ("mlacp-rendezvous-" + std::to_string(gone) + "-4242-Ab12Cd");
  const fs::path reused_pid = tmp / ("mlacp-train-" + std::to_string(getpid()) + "-1-progress.jsonl");
  const fs::path live = owned_temp_path("train") + "-progress.jsonl", other = tmp / "mlacp-fuzz-keep";
  fs::create_directories(killed_launch);
  std::ofstream(killed_launch / "store") << "x";
  for (const fs::path& p : {reused_pid, live, other}) std::ofstream(p) << "x";
  const Launch run = run_sh(1, "true");
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_FALSE(fs::exists(killed_launch));
  EXPECT_FALSE(fs::exists(reused_pid));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp)) left.push_back(e.path().filename().string());
  EXPECT_EQ(left.size(), 2u) << "the launch's own rendezvous folder is removed when it ends";
  if (saved) setenv("TMPDIR", saved_tmpdir.c_str(), 1); else unsetenv("TMPDIR");
  fs::remove_all(tmp);
  expect_no_children();
}

TEST(Launcher, RejectsBadOptions) {
  LaunchOptions options;
  options.nproc = 0;
  EXPECT_THROW(launch_local(options, {}), mlacp::Error);
  options.nproc = 1;
  options.master_port = 70000;
  EXPECT_THROW(launch_local(options, {}), mlacp::Error);
}

TEST(Launcher, PickFreePortReturnsABindableLoopbackPort) {
  const int port = pick_free_port();
  ASSERT_GT(port, 0);
  ASSERT_LT(port, 65536);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  close(fd);
}

}  // namespace
}  // namespace mlacp::tools
