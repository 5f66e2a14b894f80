// Argument checks of the ops: an InvalidArgument whose message starts with
// the op's name.
#pragma once

#include <cstdint>
#include <string>

#include "turnout/config.hpp"
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

// A number in a message.
inline std::string str(int64_t v) {
  return std::to_string(v);
}

// Checks the normal-mode ops share.
inline void check_num_experts(const char* op, int num_experts, int num_ranks) {
  require(num_experts > 0 && num_experts % num_ranks == 0, op, [&] {
    return "num_experts must be a positive multiple of the group size " + str(num_ranks) + ", got " + str(num_experts);
  });
}

inline void check_num_topk(const char* op, int num_topk) {
  require(num_topk >= 0 && num_topk <= kMaxTopk, op,
          [&] { return "num_topk must be in [0, " + str(kMaxTopk) + "], got " + str(num_topk); });
}

}  // namespace turnout::ops
