// Shared by the reference tests: the call must throw std::invalid_argument
// whose message contains `needle` (the argument it names).
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

template <class F>
void expect_invalid_argument(F&& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected std::invalid_argument mentioning '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
