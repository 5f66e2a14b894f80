// Waiting on sockets against one deadline, for the host's own exchanges (the
// TCP bootstrap, the file-descriptor exchange): every wait is a poll() with
// the time left, so nothing outlives the deadline.
#pragma once

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <string>
#include <system_error>
#include <vector>

namespace turnout::net {

using Clock = std::chrono::steady_clock;

// What wait_fd returns at the deadline (no errno is negative).
inline constexpr int kTimedOut = -2;

inline std::string errno_text(int err) {
  return std::generic_category().message(err);
}

// "rank 3" or "ranks 1, 4".
inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

inline Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = Clock::now();
  // A huge timeout means "wait forever"; adding it to now would overflow.
  if (timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now))
    return Clock::time_point::max();
  return now + timeout;
}

inline int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<decltype(left)>(left, 0, INT_MAX));
}

// 0 when `fd` is ready (errors and hang-ups count: the next call reports
// them), kTimedOut at the deadline, else the errno of poll().
inline int wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = poll(&p, 1, ms_left(deadline));
    if (rc > 0) return 0;
    if (rc == 0 && Clock::now() >= deadline) return kTimedOut;
    if (rc < 0 && errno != EINTR) return errno;
  }
}

}  // namespace turnout::net
