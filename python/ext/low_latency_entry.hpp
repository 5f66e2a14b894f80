// The low-latency combine as _C hands it to turnout._torch_ext: a C function
// behind a capsule, so the extension built against torch queues a combine
// whose checks and output it made itself, with no Python argument parsing in
// between. As intranode_entry.hpp: both modules are built from these headers
// in one build, and the sizes catch a mix of two builds.
#pragma once

#include <Python.h>

#include <cstdint>

#include "turnout/low_latency.hpp"

namespace turnout::bindings {

inline constexpr const char* kLowLatencyEntryName = "turnout._C.low_latency_entry";

struct LowLatencyEntry {
  uint32_t entry_size;    // sizeof(LowLatencyEntry)
  uint32_t combine_size;  // sizeof(LowLatencyCombineArgs)
  // GIL held: the combine on `native` (a _C.Buffer), phase `phase`, queued on
  // `stream` after `*wait_for` where that is not null; with `ring` (a
  // _C.EventRing) it records the ring's next event after the launch. 1 when
  // `native` or `ring` (unless None) is not of _C's types (nothing done, no
  // error set); 0 when queued, `*event` then a new reference to the ring's
  // event or to None; -1 with the Python error set as _C's own calls set it.
  int (*combine)(PyObject* native, const LowLatencyCombineArgs* args, int phase, uintptr_t stream,
                 const uintptr_t* wait_for, PyObject* ring, PyObject** event);
};

}  // namespace turnout::bindings
