// Argument checks of the ops: an InvalidArgument whose message starts with
// the op's name.
#pragma once

#include <string>

#include "turnout/error.hpp"

namespace turnout::ops {

inline void require(bool ok, const char* op, const char* what) {
  if (!ok) throw InvalidArgument(std::string(op) + ": " + what);
}

// Checks run on every call: a message with values is built only when one fails.
template <class Message>
void require(bool ok, const char* op, Message&& what) {
  if (!ok) throw InvalidArgument(std::string(op) + ": " + what());
}

}  // namespace turnout::ops
