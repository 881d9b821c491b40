// A plain text table for the command's reports (left-aligned first column, right-aligned rest).
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace mlacp::tools {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& out) const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// "1.23e-11"
std::string sci(double value, int digits = 2);
// "123.4"
std::string fixed(double value, int digits = 1);

}  // namespace mlacp::tools
