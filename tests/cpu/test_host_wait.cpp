// The one host wait loop: it ends when ready, at the deadline, on an error
// from its poll hook, and when the interrupt check says so (Ctrl-C in Python).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>

#include "runtime/host_wait.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

using namespace std::chrono_literals;

constexpr HostWaitPolicy kPolicy{200us, 50us};

std::atomic<int> g_checks{0};
std::atomic<int> g_interrupt_after{-1};

bool counting_check() {
  return ++g_checks == g_interrupt_after.load();
}

struct InterruptCheckGuard {
  InterruptCheckGuard(int after) {
    g_checks = 0;
    g_interrupt_after = after;
    set_interrupt_check(counting_check);
  }
  ~InterruptCheckGuard() { set_interrupt_check(nullptr); }
};

TEST(HostWait, ReturnsWhenReady) {
  const auto start = HostClock::now();
  const bool ready = host_wait("op", start + 10s, kPolicy, [&] { return HostClock::now() - start > 3ms; }, [] {});
  EXPECT_TRUE(ready);
  EXPECT_LT(HostClock::now() - start, 2s);
}

TEST(HostWait, ReturnsFalseAtTheDeadline) {
  const auto start = HostClock::now();
  EXPECT_FALSE(host_wait("op", start + 30ms, kPolicy, [] { return false; }, [] {}));
  EXPECT_GE(HostClock::now() - start, 30ms);
  EXPECT_LT(HostClock::now() - start, 5s);
}

TEST(HostWait, AnErrorFromThePollHookEndsIt) {
  int polls = 0;
  EXPECT_THROW(host_wait(
                   "op", HostClock::now() + 10s, kPolicy, [] { return false; },
                   [&] {
                     if (++polls == 5) throw TimeoutError("a peer timed out");
                   }),
               TimeoutError);
  EXPECT_EQ(polls, 5);
}

TEST(HostWait, TheInterruptCheckEndsItNamingTheOp) {
  InterruptCheckGuard guard(3);
  const auto start = HostClock::now();
  try {
    host_wait("dispatch", start + 10s, kPolicy, [] { return false; }, [] {});
    FAIL() << "the wait did not stop";
  } catch (const Interrupted& e) {
    EXPECT_NE(std::string(e.what()).find("dispatch"), std::string::npos) << e.what();
  }
  EXPECT_EQ(g_checks.load(), 3);
  // Asked every kInterruptPeriod: three asks take about three periods.
  EXPECT_GE(HostClock::now() - start, 3 * kInterruptPeriod);
  EXPECT_LT(HostClock::now() - start, 2s);
}

TEST(HostWait, ShortWaitsNeverAskAndNoCheckMeansNoInterrupt) {
  {
    InterruptCheckGuard guard(1);
    const auto start = HostClock::now();
    EXPECT_TRUE(host_wait("op", start + 10s, kPolicy, [&] { return HostClock::now() - start > 1ms; }, [] {}));
    EXPECT_EQ(g_checks.load(), 0) << "a wait shorter than one period must not pay for the check";
  }
  const auto start = HostClock::now();
  EXPECT_FALSE(host_wait("op", start + 3 * kInterruptPeriod, kPolicy, [] { return false; }, [] {}));
}

}  // namespace
}  // namespace turnout
