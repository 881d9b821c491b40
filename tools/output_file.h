// Output files named on the command line (--json, ...): written with their failure reported,
// never ignored. (Whether the path can be written at all is checked while the command line is
// parsed: option_checks.h's output_file().)
#pragma once

#include <string>

namespace mlacp::tools {

// Writes `text` to `path`; throws mlacp::Error (naming the flag, the path and the reason) when
// the write or the close fails.
void write_output_file(const std::string& flag, const std::string& path, const std::string& text);

}  // namespace mlacp::tools
