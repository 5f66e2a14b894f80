// The intranode dispatch and combine as _C hands them to turnout._torch_ext:
// C functions behind a capsule, so the extension built against torch launches
// an op whose checks and outputs it made itself, with no Python argument
// parsing in between, and _C still links no libtorch. Both modules are built from these
// headers in one build; the sizes below catch a mix of two builds.
#pragma once

#include <Python.h>

#include <cstdint>

#include "turnout/intranode.hpp"

namespace turnout::bindings {

inline constexpr const char* kIntranodeEntryName = "turnout._C.intranode_entry";

// What the counts step of a dispatch that waits for them tells the host
// (DispatchCounts as plain fields); the per-expert counts go to `per_expert`.
struct WaitedCounts {
  int num_recv_tokens;
  int own_rows_begin;
  int num_own_rows;
  int num_local_experts;  // the room at per_expert, L
  int* per_expert;
};

struct IntranodeEntry {
  uint32_t entry_size;    // sizeof(IntranodeEntry)
  uint32_t args_size;     // sizeof(DispatchArgs)
  uint32_t counts_size;   // sizeof(DispatchCountsArgs)
  uint32_t combine_size;  // sizeof(CombineArgs)
  uint32_t waited_size;   // sizeof(WaitedCounts)
  // Each: GIL held; the op on `native` (a _C.Buffer) with `config` (a
  // _C.Config)'s channels, queued on `stream`. 1 when `native` or `config` is
  // not of _C's types (nothing done, no error set), 0 when queued, -1 with
  // the Python error set as _C's own calls set it.
  // A dispatch whose receive rows are known (num_worst_tokens).
  int (*dispatch_known_rows)(PyObject* native, PyObject* config, DispatchCountsArgs* counts, DispatchArgs* args,
                             uintptr_t stream);
  int (*combine)(PyObject* native, PyObject* config, CombineArgs* args, uintptr_t stream);
  // A fresh dispatch without num_worst_tokens: its counts step, which waits
  // for the receive counts with the GIL released, then its data step into
  // outputs sized from them.
  int (*dispatch_counts)(PyObject* native, PyObject* config, DispatchCountsArgs* counts, WaitedCounts* out,
                         uintptr_t stream);
  int (*dispatch)(PyObject* native, PyObject* config, DispatchArgs* args, uintptr_t stream);
};

}  // namespace turnout::bindings
