#include "table.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <iomanip>

namespace mlacp::tools {

void Table::print(std::ostream& out) const {
  std::vector<size_t> width(header_.size(), 0);
  auto measure = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) width[i] = std::max(width[i], row[i].size());
  };
  measure(header_);
  for (const auto& row : rows_) measure(row);
  auto emit = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size() && i < width.size(); ++i) {
      if (i) out << "  ";
      const bool numeric = !row[i].empty() && (std::isdigit(static_cast<unsigned char>(row[i][0])) ||
                                               (row[i][0] == '-' && row[i].size() > 1));
      out << (numeric ? std::right : std::left) << std::setw(static_cast<int>(width[i])) << row[i];
    }
    out << std::right << "\n";
  };
  emit(header_);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  out << std::string(total > 2 ? total - 2 : 0, '-') << "\n";
  for (const auto& row : rows_) emit(row);
}

std::string sci(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*e", digits, value);
  return buffer;
}

std::string fixed(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", digits, value);
  return buffer;
}

}  // namespace mlacp::tools
