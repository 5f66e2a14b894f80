#include <atomic>
#include <string>

#include "runtime/host_wait.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

std::atomic<InterruptCheck> g_check{nullptr};

}  // namespace

void set_interrupt_check(InterruptCheck check) {
  g_check.store(check, std::memory_order_release);
}

void check_interrupt(const char* op) {
  const InterruptCheck check = g_check.load(std::memory_order_acquire);
  if (check && check()) throw Interrupted(std::string(op) + ": the host wait was interrupted");
}

}  // namespace turnout
