// mlacp errors. Every rejection throws mlacp::Error with one text shape:
//   "mlacp: <what>: <rule>; got <name>=<value>, ...; <hint>"
// built from the same constants the check uses, so the message and the check cannot drift.
// Library code never exits or aborts.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mlacp {

// One named value shown in an error message ("heads=7").
struct ErrorValue {
  std::string name;
  std::string value;
};

template <typename T>
ErrorValue got(std::string name, const T& value) {
  std::ostringstream out;
  out << std::boolalpha << value;
  return {std::move(name), out.str()};
}
ErrorValue got(std::string name, const std::vector<int64_t>& values);

// What kind of mistake an Error reports (the tool's exit code follows it: README "Exit codes"):
// an input that breaks a rule, found before any work (the default), or a fault found while
// running: a peer that died or stalled, an allocation that failed, an unreadable file.
enum class ErrorKind { input, fault };

class Error : public std::runtime_error {
 public:
  Error(std::string what, std::string rule, std::vector<ErrorValue> values, std::string hint,
        ErrorKind kind = ErrorKind::input);
  ErrorKind kind() const { return kind_; }
  const std::string& subject() const { return subject_; }
  const std::string& rule() const { return rule_; }
  const std::vector<ErrorValue>& values() const { return values_; }
  const std::string& hint() const { return hint_; }

 private:
  std::string subject_;
  std::string rule_;
  std::vector<ErrorValue> values_;
  std::string hint_;
  ErrorKind kind_ = ErrorKind::input;
};

[[noreturn]] inline void fail(const std::string& what, const std::string& rule, std::vector<ErrorValue> values,
                              const std::string& hint) {
  throw Error(what, rule, std::move(values), hint);
}
[[noreturn]] inline void fail_fault(const std::string& what, const std::string& rule, std::vector<ErrorValue> values,
                                    const std::string& hint) {
  throw Error(what, rule, std::move(values), hint, ErrorKind::fault);
}

}  // namespace mlacp

// MLACP_REQUIRE(condition, what, rule, {got("name", value), ...}, hint)
// Throws mlacp::Error unless `condition` holds. The message arguments are evaluated only on
// failure, so checks on hot paths cost nothing and may name values that only exist then.
#define MLACP_REQUIRE(condition, ...)             \
  do {                                            \
    if (!(condition)) ::mlacp::fail(__VA_ARGS__); \
  } while (0)

namespace mlacp {

}  // namespace mlacp
