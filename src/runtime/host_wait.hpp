// The one host wait loop: poll until ready or the deadline, yielding the core
// at first (a sleep costs ~50 us of timer slack after the event), then
// sleeping; every few milliseconds ask the interrupt check.
#pragma once

#include <chrono>
#include <thread>

namespace turnout {

using HostClock = std::chrono::steady_clock;

struct HostWaitPolicy {
  std::chrono::nanoseconds yield_for;  // poll back to back (yielding) this long
  std::chrono::microseconds nap;       // then sleep this long between polls
};

// A wait for work that usually takes microseconds: poll back to back briefly,
// then stop burning a core.
inline constexpr HostWaitPolicy kShortWait{std::chrono::microseconds(200), std::chrono::microseconds(50)};
// A wait for the peers (a dispatch's receive counts): a sleep costs the timer
// slack (~50 us) after they land, so the first second only yields; a wait that
// long hides a sleep's cost.
inline constexpr HostWaitPolicy kPeerWait{std::chrono::seconds(1), std::chrono::microseconds(50)};

// How often a wait asks the interrupt check.
inline constexpr std::chrono::milliseconds kInterruptPeriod{10};

// Throws turnout::Interrupted naming `op` if the interrupt check says so.
void check_interrupt(const char* op);

// Calls ready() until it returns true (then true) or the deadline passes (then
// false). on_poll() runs before each poll and may throw to end the wait.
template <typename Ready, typename OnPoll>
bool host_wait(const char* op, HostClock::time_point deadline, const HostWaitPolicy& policy, Ready&& ready,
               OnPoll&& on_poll) {
  const auto start = HostClock::now();
  auto next_check = start + kInterruptPeriod;
  for (;;) {
    on_poll();
    if (ready()) return true;
    const auto now = HostClock::now();
    if (now > deadline) return false;
    if (now >= next_check) {
      check_interrupt(op);
      next_check = now + kInterruptPeriod;
    }
    if (now - start < policy.yield_for)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(policy.nap);
  }
}

}  // namespace turnout
