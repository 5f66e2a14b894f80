// Private to the _C module: what its binding files share. Tensors arrive as
// raw device addresses (the Python layer has checked them) and streams as
// handles, so a call costs no DLPack conversion and the module links no libtorch.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <exception>
#include <optional>

#include "turnout/turnout.hpp"

namespace turnout::bindings {

namespace nb = nanobind;

using BufferClass = nb::class_<Buffer>;

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

inline cudaStream_t stream(uintptr_t handle) {
  return reinterpret_cast<cudaStream_t>(handle);
}

// The stream joins around an op, folded into its first and last native call
// (each call into the extension costs about a microsecond): the op's stream
// waits for `wait_for` before the launch, `join_to` waits for the op's stream
// after it. None: no join (0 is a stream, the legacy default one).
using MaybeStream = std::optional<uintptr_t>;

inline void join_before(Buffer& buffer, uintptr_t op_stream, MaybeStream wait_for) {
  if (wait_for) buffer.join(stream(op_stream), stream(*wait_for));
}

inline void join_after(Buffer& buffer, uintptr_t op_stream, MaybeStream join_to) {
  if (join_to) buffer.join(stream(*join_to), stream(op_stream));
}

// GIL held: the Python error for the exception `p`, as the module's own
// calls raise it (for calls that enter the core other than through nanobind).
void set_python_error(const std::exception_ptr& p);

void bind_config(nb::module_& m);
// CommEvent and EventRing (comm_events.hpp), before the low-latency ops that return them.
void bind_events(nb::module_& m);
// Construction, properties and the calls every mode shares; the mode files add
// their ops to the class it returns.
BufferClass bind_buffer(nb::module_& m);
void bind_layout(BufferClass& buffer);
void bind_intranode(BufferClass& buffer);
void bind_internode(BufferClass& buffer);
// Module-level too: the size functions, limits and phase numbers.
void bind_low_latency(nb::module_& m, BufferClass& buffer);

}  // namespace turnout::bindings
