// Host waits (for the receive counts, for the GPU) ask this check every few
// milliseconds and throw turnout::Interrupted when it says so. None is set by
// default; the Python module sets one that runs Python's signal handlers, so
// Ctrl-C during a wait raises KeyboardInterrupt.
#pragma once

namespace turnout {

// Returns true when the wait in progress should stop. Called from the waiting
// thread; must be cheap and must not throw.
using InterruptCheck = bool (*)();

// Process-wide; nullptr removes it.
void set_interrupt_check(InterruptCheck check);

}  // namespace turnout
