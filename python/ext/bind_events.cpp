// CommEvent and EventRing (comm_events.hpp). The ring lives here, in the
// binding layer, not in the C++ Buffer: only the Python layer's async_finish
// hands out events (a C++ caller records its own on the streams it passes).
#include <string>

#include "bindings.hpp"
#include "comm_events.hpp"
#include "turnout/error.hpp"

namespace turnout::bindings {

using namespace nb::literals;

EventRing::EventRing(int device, int size) {
  if (size < 1) throw InvalidArgument("EventRing: size must be >= 1, got " + std::to_string(size));
  int current = -1;
  TURNOUT_CUDA_CHECK(cudaGetDevice(&current));
  if (device != current)
    throw InvalidArgument("EventRing: device must be the current CUDA device (" + std::to_string(current) + "), got " +
                          std::to_string(device));
  objects_.reserve(size);
  events_.reserve(size);
  for (int i = 0; i < size; ++i) {
    nb::object event = nb::cast(CommEvent(create_event()), nb::rv_policy::move);
    events_.push_back(nb::inst_ptr<CommEvent>(event));
    objects_.push_back(std::move(event));
  }
}

nb::object EventRing::record(cudaStream_t s) {
  TURNOUT_CUDA_CHECK(cudaEventRecord(events_[next_]->get(), s));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  captured_ = status != cudaStreamCaptureStatusNone;
  nb::object event = objects_[next_];
  next_ = (next_ + 1) % events_.size();
  return event;
}

namespace {

void wait(const CommEvent& event, uintptr_t s) {
  TURNOUT_CUDA_CHECK(cudaStreamWaitEvent(stream(s), event.get(), 0));
}

bool query(const CommEvent& event) {
  const cudaError_t status = cudaEventQuery(event.get());
  if (status == cudaSuccess) return true;
  // Not finished, or last recorded inside a CUDA-graph capture (a later call
  // records it again eagerly): no error, and none may stay behind for the
  // next kernel launch's check to report.
  if (status == cudaErrorNotReady || status == cudaErrorCapturedEvent) {
    (void)cudaGetLastError();
    return false;
  }
  detail::throw_cuda_error(status, "cudaEventQuery(event)", __FILE__, __LINE__);
}

// Host wait. Nothing to wait for once the CUDA runtime is unloading (at exit)
// or for an event last recorded inside a capture.
void synchronize(const CommEvent& event) {
  const cudaError_t status = cudaEventSynchronize(event.get());
  if (status == cudaSuccess) return;
  if (status == cudaErrorCudartUnloading || status == cudaErrorCapturedEvent) {
    (void)cudaGetLastError();
    return;
  }
  detail::throw_cuda_error(status, "cudaEventSynchronize(event)", __FILE__, __LINE__);
}

}  // namespace

void bind_events(nb::module_& m) {
  nb::class_<CommEvent>(m, "CommEvent",
                        "The event a low-latency call with async_finish recorded on the communication stream.")
      .def("wait", &wait, "stream"_a, "Makes the CUDA stream of this handle wait for the event.")
      .def("query", &query, "True once the work recorded before the event has finished.")
      .def("synchronize", &synchronize, nb::call_guard<nb::gil_scoped_release>(),
           "Waits on the host until the work recorded before the event has finished.");
  nb::class_<EventRing>(m, "EventRing")
      .def(nb::init<int, int>(), "device"_a, "size"_a)
      .def_prop_ro("size", &EventRing::size)
      .def_prop_ro("captured", &EventRing::captured,
                   "Whether the last event was recorded inside a CUDA-graph capture.");
}

}  // namespace turnout::bindings
