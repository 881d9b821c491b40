#include "option_checks.h"

#include <net/if.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <sstream>

#include "mlacp/errors.h"

namespace mlacp::tools {
namespace {

namespace fs = std::filesystem;

// The text of an mlacp::Error without its "mlacp: <subject>: " head: CLI11 puts the option's name
// there ("--dv: must be an integer > 0; got value=0").
std::string rejection(const std::string& rule, std::vector<ErrorValue> values, const std::string& hint = "") {
  const std::string head = "mlacp: option: ";
  return std::string(Error("option", rule, std::move(values), hint).what()).substr(head.size());
}

std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// The whole text as a finite double, or nothing.
bool parse_finite(const std::string& text, double& value) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  value = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && errno != ERANGE && std::isfinite(value);
}

CLI::Validator number_rule(const std::string& description, const std::string& rule,
                           const std::function<bool(double)>& accepts) {
  return CLI::Validator(
      [rule, accepts](std::string& input) -> std::string {
        double v = 0.0;
        return parse_finite(input, v) && accepts(v) ? std::string() : rejection(rule, {got("value", input)});
      },
      description);
}

// ---- paths -------------------------------------------------------------------------------------

std::string errno_text(const fs::path& p) { return p.string() + ": " + std::strerror(errno); }

// The folder `p` sits in ("." for a bare name).
fs::path folder_of(const fs::path& p) { return p.has_parent_path() ? p.parent_path() : fs::path("."); }

// Why `p` cannot be written, or "" (the checks of output_file / output_folder).
std::string output_file_problem(const fs::path& p) {
  std::error_code ec;
  if (fs::is_directory(p, ec)) return "it is a folder";
  const fs::path folder = folder_of(p);
  if (!fs::exists(folder, ec)) return "the folder " + folder.string() + " does not exist";
  if (!fs::is_directory(folder, ec)) return folder.string() + " is not a folder";
  if (fs::exists(p, ec)) return access(p.c_str(), W_OK) == 0 ? "" : errno_text(p);
  return access(folder.c_str(), W_OK | X_OK) == 0 ? "" : errno_text(folder);
}

std::string output_folder_problem(const fs::path& p) {
  std::error_code ec;
  fs::path existing = p;  // the path itself, else its nearest existing ancestor
  while (!fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
    existing = existing.parent_path();
  if (!fs::exists(existing, ec)) existing = ".";  // a relative path with no existing part
  if (!fs::is_directory(existing, ec))
    return existing == p ? "it exists and is not a folder" : existing.string() + " is not a folder";
  return access(existing.c_str(), W_OK | X_OK) == 0 ? "" : errno_text(existing);
}

enum class InputKind { file, folder, either };

std::string input_problem(const fs::path& p, InputKind kind) {
  std::error_code ec;
  if (!fs::exists(p, ec)) return "it does not exist";
  const bool folder = fs::is_directory(p, ec), file = fs::is_regular_file(p, ec);
  if (kind == InputKind::file && !file) return folder ? "it is a folder" : "it is not a regular file";
  if (kind == InputKind::folder && !folder) return "it is not a folder";
  if (kind == InputKind::either && !file && !folder) return "it is neither a regular file nor a folder";
  return access(p.c_str(), folder ? R_OK | X_OK : R_OK) == 0 ? "" : errno_text(p);
}

CLI::Validator path_rule(const std::string& description, const std::string& rule, const std::string& hint,
                         const std::function<std::string(const fs::path&)>& problem) {
  return CLI::Validator(
      [rule, hint, problem](std::string& input) -> std::string {
        const std::string why = input.empty() ? std::string("empty path") : problem(input);
        return why.empty() ? std::string() : rejection(rule, {got("path", input), got("reason", why)}, hint);
      },
      description);
}

}  // namespace

CLI::Validator int_range(int64_t lo, int64_t hi) {
  const std::string bounds = "[" + std::to_string(lo) + " - " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi](std::string& input) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long v = input.empty() ? 0 : std::strtoll(input.c_str(), &end, 10);
        const bool integer = !input.empty() && end == input.c_str() + input.size() && errno != ERANGE;
        if (integer && v >= lo && v <= hi) return "";
        return rejection("must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
                         {got("value", input)});
      },
      "INT in " + bounds);
}

CLI::Validator float_range(double lo, double hi) {
  return number_rule("FLOAT in [" + number_text(lo) + " - " + number_text(hi) + "]",
                     "must be a finite number in [" + number_text(lo) + ", " + number_text(hi) + "]",
                     [lo, hi](double v) { return v >= lo && v <= hi; });
}

CLI::Validator positive() {
  return number_rule("POSITIVE", "must be a finite number > 0", [](double v) { return v > 0.0; });
}

CLI::Validator non_negative() {
  return number_rule("NONNEGATIVE", "must be a finite number >= 0", [](double v) { return v >= 0.0; });
}

CLI::Validator output_file() {
  return path_rule("OUTPUT_FILE", "must name a file that can be written",
                   "pass a path in an existing, writable folder (e.g. /tmp/mlacp.out)", output_file_problem);
}

CLI::Validator output_folder() {
  return path_rule("OUTPUT_FOLDER", "must name a folder that can be written or created",
                   "pass a writable folder, or a new one under one (e.g. /tmp/mlacp-out)", output_folder_problem);
}

CLI::Validator input_file() {
  return path_rule("INPUT_FILE", "must name a readable file", "check the path",
                   [](const fs::path& p) { return input_problem(p, InputKind::file); });
}

CLI::Validator input_folder() {
  return path_rule("INPUT_FOLDER", "must name a readable folder", "check the path",
                   [](const fs::path& p) { return input_problem(p, InputKind::folder); });
}

CLI::Validator input_path() {
  return path_rule("INPUT_PATH", "must name a readable file or folder", "check the path",
                   [](const fs::path& p) { return input_problem(p, InputKind::either); });
}

CLI::Validator profile_or_input_file(const std::vector<std::string>& profiles) {
  std::string names;
  for (const std::string& p : profiles) names += (names.empty() ? "" : ", ") + p;
  return path_rule("PROFILE_OR_INPUT_FILE", "must name a profile or a readable file", "the profiles: " + names,
                   [profiles](const fs::path& p) {
                     const bool profile = std::find(profiles.begin(), profiles.end(), p.string()) != profiles.end();
                     return profile ? std::string() : input_problem(p, InputKind::file);
                   });
}

CLI::Validator network_interfaces() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        std::stringstream in(input);
        std::string name;
        int names = 0;
        bool bad = input.empty() || input.back() == ',';
        while (std::getline(in, name, ',')) {
          ++names;
          bad = bad || name.empty() || name.size() >= IF_NAMESIZE || if_nametoindex(name.c_str()) == 0;
        }
        if (names > 0 && !bad) return "";
        return rejection("must name network interfaces of this host, comma-separated", {got("value", input)},
                         "ip -brief link lists them (e.g. eth0, or lo for one host)");
      },
      "INTERFACES");
}

}  // namespace mlacp::tools
