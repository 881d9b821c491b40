#include "mlacp/errors.h"

namespace mlacp {
namespace {

std::string render(const std::string& what, const std::string& rule,
                   const std::vector<ErrorValue>& values, const std::string& hint) {
  std::string text = "mlacp: " + what + ": " + rule;
  if (!values.empty()) {
    text += "; got ";
    for (size_t i = 0; i < values.size(); ++i) {
      if (i) text += ", ";
      text += values[i].name + "=" + values[i].value;
    }
  }
  if (!hint.empty()) text += "; " + hint;
  return text;
}

}  // namespace

ErrorValue got(std::string name, const std::vector<int64_t>& values) {
  std::string text = "[";
  const size_t shown = std::min<size_t>(values.size(), 16);
  for (size_t i = 0; i < shown; ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  if (shown < values.size()) text += ", ... (" + std::to_string(values.size()) + " values)";
  return {std::move(name), text + "]"};
}

Error::Error(std::string what, std::string rule, std::vector<ErrorValue> values, std::string hint, ErrorKind kind)
    : std::runtime_error(render(what, rule, values, hint)),
      subject_(std::move(what)),
      rule_(std::move(rule)),
      values_(std::move(values)),
      hint_(std::move(hint)),
      kind_(kind) {}

}  // namespace mlacp
