// Shared by the bootstrap and fd-passing tests: ranks as threads of one
// process, what each of them threw, and the signals that interrupt their waits.
#pragma once

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>

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

// Runs fn(rank) for ranks [0, count) on threads as run_ranks does, while
// every rank gets a SIGUSR1 each 200 us until all have returned. The handler
// counts them (signals_handled, reset here) and is installed without
// SA_RESTART, so every blocking call of a rank can return EINTR.
inline std::vector<std::exception_ptr> run_ranks_under_signals(int count, const std::function<void(int)>& fn) {
  struct sigaction quiet{};
  quiet.sa_handler = count_signal;
  struct sigaction old{};
  signals_handled = 0;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(count));
  if (sigaction(SIGUSR1, &quiet, &old) != 0) {
    ADD_FAILURE() << "sigaction failed";
    return errors;
  }
  std::vector<pthread_t> ids(static_cast<size_t>(count));
  std::atomic<int> started{0}, finished{0};
  std::atomic<bool> release{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < count; ++r)
    threads.emplace_back([&, r] {
      ids[static_cast<size_t>(r)] = pthread_self();
      ++started;
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
      ++finished;
      // Stay alive until the signals stop: pthread_kill needs a live thread.
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  while (started < count) std::this_thread::yield();
  while (finished < count) {
    for (pthread_t id : ids) pthread_kill(id, SIGUSR1);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  release = true;
  for (auto& t : threads) t.join();
  sigaction(SIGUSR1, &old, nullptr);
  return errors;
}

}  // namespace turnout::thread_ranks
