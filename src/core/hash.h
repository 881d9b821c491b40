// FNV-1a (64-bit): a stable hash of text, the same in every process and build (plan
// fingerprints, agreement checks across ranks).
#pragma once

#include <cstdint>
#include <string>

namespace mlacp {

inline uint64_t fnv1a64(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char ch : text) {
    hash ^= ch;
    hash *= 1099511628211ull;
  }
  return hash;
}

}  // namespace mlacp
