// Test helper: run a callable that must throw mlacp::Error and get its message.
#pragma once

#include <exception>
#include <string>

#include <gtest/gtest.h>

#include "mlacp/errors.h"

namespace mlacp::test {

// Runs f, expects it to throw mlacp::Error, returns the error's message (a test failure and ""
// when nothing, or something else, was thrown).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mlacp::Error, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected mlacp::Error, nothing was thrown";
  return {};
}

}  // namespace mlacp::test
