// The low-latency dispatch and combine as _C hands them to turnout._torch_ext:
// C functions behind a capsule, so the extension built against torch queues
// an op whose checks (and, for combine, output) it made itself, with no
// Python argument parsing in between. As intranode_entry.hpp: both modules are built from these headers
// in one build, and the sizes catch a mix of two builds.
#pragma once

#include <Python.h>

#include <cstdint>

#include "turnout/low_latency.hpp"

namespace turnout::bindings {

inline constexpr const char* kLowLatencyEntryName = "turnout._C.low_latency_entry";

struct LowLatencyEntry {
  uint32_t entry_size;     // sizeof(LowLatencyEntry)
  uint32_t dispatch_size;  // sizeof(LowLatencyDispatchArgs)
  uint32_t combine_size;   // sizeof(LowLatencyCombineArgs)
  // Each: GIL held; the op on `native` (a _C.Buffer), phase `phase`, queued
  // on `stream` after `*wait_for` where that is not null; with `ring` (a
  // _C.EventRing) it records the ring's next event after the launch. 1 when
  // `native`, `outputs` or `ring` (unless None) is not of _C's types (nothing
  // done, no error set); 0 when queued, `*event` then a new reference to the
  // ring's event or to None; -1 with the Python error set as _C's own calls
  // set it.
  // A dispatch into `outputs` (a _C.LowLatencyDispatchArgs: the output set's
  // fields) with the call's fields of `call` (with_call in
  // bind_low_latency.cpp says which).
  int (*dispatch)(PyObject* native, PyObject* outputs, const LowLatencyDispatchArgs* call, int phase, uintptr_t stream,
                  const uintptr_t* wait_for, PyObject* ring, PyObject** event);
  int (*combine)(PyObject* native, const LowLatencyCombineArgs* args, int phase, uintptr_t stream,
                 const uintptr_t* wait_for, PyObject* ring, PyObject** event);
};

}  // namespace turnout::bindings
