// Reports whether c10d's Gloo backend works in this build (used by `mlacp info`).
#pragma once

#include <string>

namespace mlacp {

struct GlooProbe {
  bool available = false;
  std::string detail;  // what was tried, or why it failed
};

// Builds a 1-rank Gloo process group on loopback and runs one all-reduce.
GlooProbe probe_gloo();

}  // namespace mlacp
