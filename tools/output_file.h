// Output files named on the command line (--json, ...): checked before any work or rank starts,
// written with their failure reported, never ignored.
#pragma once

#include <string>

namespace mlacp::tools {

// Throws mlacp::Error (naming the flag, the path and the reason) unless `path` can be opened for
// writing: its folder exists, it is not a folder, it is writable. Leaves no file behind.
void check_output_file(const std::string& flag, const std::string& path);
// Writes `text` to `path`; throws mlacp::Error when the write or the close fails.
void write_output_file(const std::string& flag, const std::string& path, const std::string& text);

}  // namespace mlacp::tools
