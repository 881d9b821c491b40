#include "output_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "mlacp/errors.h"

namespace mlacp::tools {
namespace {

[[noreturn]] void fail_write(const std::string& flag, const std::string& path, const std::string& reason) {
  throw Error("output file", flag + " must name a file that can be written",
              {got("path", path), got("reason", reason)},
              "pass a path in an existing, writable folder (e.g. " + flag + " /tmp/mlacp.json)");
}

}  // namespace

void write_output_file(const std::string& flag, const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) fail_write(flag, path, std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed) fail_write(flag, path, std::strerror(written ? errno : write_errno));
}

}  // namespace mlacp::tools
