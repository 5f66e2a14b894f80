// Shared by the bootstrap and fd-passing tests: ranks as threads of one
// process, what each of them threw, and the signals that interrupt their waits.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace turnout::thread_ranks {

// Runs fn(rank) for ranks [0, count) on threads; returns what each threw.
inline std::vector<std::exception_ptr> run_ranks(int count, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(count));
  std::vector<std::thread> threads;
  for (int r = 0; r < count; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " threw: " << e.what();
    }
  }
}

// Returns the message if `error` holds an E, else fails and returns "".
template <class E>
std::string message_of(const std::exception_ptr& error, int rank) {
  if (!error) {
    ADD_FAILURE() << "rank " << rank << " threw nothing";
    return "";
  }
  try {
    std::rethrow_exception(error);
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << rank << " threw the wrong type: " << e.what();
  }
  return "";
}

// SIGUSR1s the handler of the signal tests has taken (it counts them).
inline std::atomic<int> signals_handled{0};

inline void count_signal(int) {
  ++signals_handled;
}

// Until `count` signals have been handled, or `limit` has passed (then the
// test's count check fails): counted rather than timed, since a loaded host
// oversleeps.
inline void wait_for_signals(int count, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (signals_handled < count && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

}  // namespace turnout::thread_ranks
