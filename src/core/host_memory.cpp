#include "core/host_memory.h"

#include <fstream>
#include <sstream>
#include <string>

namespace mlacp {
namespace {

// The first number in a file ("max" or unreadable: negative).
double read_number(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  try {
    return std::stod(word);
  } catch (...) {
    return -1;
  }
}

// This process's cgroup path for a controller line prefix of /proc/self/cgroup ("0::" for v2,
// ":memory:" for v1), or "" when absent.
std::string cgroup_path(const std::string& tag) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find(tag);
    if (at != std::string::npos && (tag != "0::" || at == 0)) return line.substr(at + tag.size());
  }
  return "";
}

}  // namespace

HostMemory available_host_memory() {
  HostMemory m;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line))
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      double kib = 0;
      if (fields >> kib) {
        m.available_bytes = kib * 1024.0;
        m.source = "MemAvailable";
      }
    }
  auto lower_to = [&](double limit, double usage, const char* source) {
    if (limit <= 0 || usage < 0 || limit > 1e18) return;
    const double room = limit > usage ? limit - usage : 0;
    if (m.source.empty() || room < m.available_bytes) {
      m.available_bytes = room;
      m.source = source;
    }
  };
  // The process's own cgroup, then the hierarchy's root (a container sees its own cgroup as /).
  for (const std::string& v2 : {"/sys/fs/cgroup" + cgroup_path("0::"), std::string("/sys/fs/cgroup")})
    lower_to(read_number(v2 + "/memory.max"), read_number(v2 + "/memory.current"), "cgroup memory.max");
  for (const std::string& v1 : {"/sys/fs/cgroup/memory" + cgroup_path(":memory:"), std::string("/sys/fs/cgroup/memory")})
    lower_to(read_number(v1 + "/memory.limit_in_bytes"), read_number(v1 + "/memory.usage_in_bytes"),
             "cgroup memory.limit_in_bytes");
  return m;
}

}  // namespace mlacp
