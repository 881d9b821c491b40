// Validators for typed options, declared where each option is added (`->check(...)`) and run by
// CLI11 while the command line is parsed: before any work, any rank or any file, on the launcher
// and again on every rank (they parse the same command line). A rejected value ends as one line
//   mlacp: invalid command line: --dv: must be an integer > 0; got value=0 (mlacp <command> --help ...)
// (main.cpp prints CLI11's errors so, exit 2). Two kinds:
//  - numeric ranges: --help shows "INT in [lo - hi]", "FLOAT in [lo - hi]", "POSITIVE" or
//    "NONNEGATIVE" (tests/tools/fuzz_invalid_options.py generates values outside from it); the
//    message writes the bound as the rule, numbers in %g form (CLI11's own Range prints
//    std::to_string of its bounds: 309 digits for the largest double, "0.000000" for the
//    smallest positive one). Floating-point values must also be finite.
//  - path arguments: --help shows OUTPUT_FILE, OUTPUT_FOLDER, INPUT_FILE, INPUT_FOLDER,
//    INPUT_PATH or PROFILE_OR_INPUT_FILE; what each needs is below. Nothing is created: a path that is fine now is used
//    later by the command itself, which still reports its own write errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace mlacp::tools {

// Integers in [lo, hi].
CLI::Validator int_range(int64_t lo, int64_t hi);
// Finite numbers in [lo, hi].
CLI::Validator float_range(double lo, double hi);
// Finite numbers > 0 (integers: >= 1).
CLI::Validator positive();
// Finite numbers >= 0.
CLI::Validator non_negative();

// A file to write: not a folder; its folder exists, is a folder and is writable (and the file,
// when it exists, is writable).
CLI::Validator output_file();
// A folder to write into, created when missing: an existing one is a writable folder; a missing
// one has a writable folder as its nearest existing ancestor (no regular file on the way).
CLI::Validator output_folder();
// A readable regular file.
CLI::Validator input_file();
// A readable folder.
CLI::Validator input_folder();
// A readable regular file or folder.
CLI::Validator input_path();
// One of `profiles` (a name), else a readable regular file (the planner's --hardware).
CLI::Validator profile_or_input_file(const std::vector<std::string>& profiles);
// Comma-separated names of this host's network interfaces (--iface; --help shows INTERFACES).
CLI::Validator network_interfaces();

}  // namespace mlacp::tools
