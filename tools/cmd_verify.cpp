// `mlacp verify`: runs named correctness cases and prints the worst error per quantity.
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "check/single_device_checks.h"
#include "commands.h"
#include "table.h"

namespace mlacp::tools {

CLI::App* add_verify_command(CLI::App& app, VerifyArgs& args) {
  CLI::App* cmd = app.add_subcommand("verify", "check mlacp against the single-device float64 reference");
  cmd->add_option("--case", args.cases, "case name (repeatable); default: every case")->take_all();
  cmd->add_flag("--list", args.list, "list the named cases and exit");
  cmd->add_option("--json", args.json_path, "also write the results as JSON to this file");
  return cmd;
}

int run_verify(const CommonArgs& common, const VerifyArgs& args) {
  apply_threads(common);
  std::vector<VerifyCase> cases;
  if (args.cases.empty()) {
    cases = default_single_device_cases();
  } else {
    for (const auto& name : args.cases) cases.push_back(find_case(name));
  }
  if (args.list) {
    for (const auto& c : cases) std::cout << c.name << "\n";
    return 0;
  }
  Table table({"case", "quantity", "worst error", "tolerance", "status"});
  nlohmann::json rows = nlohmann::json::array();
  int failures = 0;
  for (const VerifyCase& c : cases) {
    std::cerr << "verify: " << c.name << " ...\n";
    for (const CheckRow& row : run_single_device_checks(c)) {
      const bool ok = row.passed();
      failures += ok ? 0 : 1;
      table.add({row.case_name, row.quantity, sci(row.error), sci(row.tolerance), ok ? "ok" : "FAIL"});
      rows.push_back({{"case", row.case_name},
                      {"quantity", row.quantity},
                      {"error", row.error},
                      {"tolerance", row.tolerance},
                      {"passed", ok}});
    }
  }
  table.print(std::cout);
  std::cout << (failures == 0 ? "verify: all " + std::to_string(rows.size()) + " checks passed\n"
                              : "verify: " + std::to_string(failures) + " of " + std::to_string(rows.size()) +
                                    " checks FAILED\n");
  if (!args.json_path.empty()) {
    std::ofstream out(args.json_path);
    out << nlohmann::json{{"mode", "single-device"}, {"passed", failures == 0}, {"rows", rows}}.dump(2) << "\n";
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace mlacp::tools
