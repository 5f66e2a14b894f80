// The events that low-latency calls with async_finish record on the
// communication stream. Each Python Buffer owns a small ring of them, made
// with the buffer: such a call creates no CUDA event and no Python object, it
// re-records the ring's next event and returns the Python object owning it.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "runtime/cuda_resources.hpp"

namespace turnout::bindings {

namespace nb = nanobind;

// Python: turnout._C.CommEvent (wait(stream), query(), synchronize()). Owns its CUDA event,
// so an EventOverlap holding it stays valid after its ring and Buffer are gone.
class CommEvent {
 public:
  explicit CommEvent(Event event) : event_(std::move(event)) {}
  cudaEvent_t get() const { return event_.get(); }

 private:
  Event event_;
};

// Python: turnout._C.EventRing.
class EventRing {
 public:
  // `size` events of `device`, which must be the current CUDA device (an event
  // belongs to the device current when it is made).
  EventRing(int device, int size);

  // Records the ring's next event on `stream` and returns its Python object.
  // That event is recorded again `size` calls later: a wait or query made
  // after that sees the later call, so it waits longer than it needed to,
  // never less (both calls are on the same stream, in order).
  nb::object record(cudaStream_t stream);

  int size() const { return static_cast<int>(events_.size()); }

  // Whether the last record() was made inside a CUDA-graph capture: the
  // Python layer then neither queries the event nor queues the call's tensors.
  // Read here, after the launch, it costs a fraction of a torch capture query.
  bool captured() const { return captured_; }

 private:
  // The Python objects own the events; the ring holds a reference to each
  // and their C++ address for record().
  std::vector<nb::object> objects_;
  std::vector<CommEvent*> events_;
  size_t next_ = 0;
  bool captured_ = false;
};

}  // namespace turnout::bindings
