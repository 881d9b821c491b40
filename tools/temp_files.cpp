#include "temp_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <vector>

namespace mlacp::tools {
namespace {

namespace fs = std::filesystem;

// The start time of process `pid` (clock ticks since boot: /proc/<pid>/stat field 22), or "" when
// no such process is alive (none, or a zombie: killed, not yet reaped).
std::string live_start_time(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the fields after "(comm)", which may hold spaces
  if (close == std::string::npos) return "";
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 3 && field == "Z") return "";
    if (i == 22) return field;
  }
  return "";
}

}  // namespace

std::string temp_dir() {
  const char* tmp = std::getenv("TMPDIR");
  return tmp && *tmp ? tmp : "/tmp";
}

std::string owned_temp_path(const std::string& what) {
  const std::string pid = std::to_string(getpid());
  return (fs::path(temp_dir()) / ("mlacp-" + what + "-" + pid + "-" + live_start_time(pid))).string();
}

void remove_stale_temp_files() {
  static const std::regex owned(R"(mlacp-[a-z]+-([0-9]+)-([0-9]+)([-.].*)?)");
  std::error_code ec;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(temp_dir(), ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    struct stat st {};
    if (!std::regex_match(name, m, owned) || lstat(entry.path().c_str(), &st) != 0 || st.st_uid != geteuid()) continue;
    if (live_start_time(m[1].str()) != m[2].str()) stale.push_back(entry.path());
  }
  for (const fs::path& p : stale) fs::remove_all(p, ec);
}

}  // namespace mlacp::tools
