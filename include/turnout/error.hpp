// Exceptions thrown at the API boundary. Each carries enough context to act on
// (which argument, which rank, which wait) because the caller is usually a
// training job far from this code.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace turnout {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed something the op cannot accept; nothing was launched.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A mode or size this build does not provide (yet).
class NotSupported : public Error {
 public:
  using Error::Error;
};

// A peer or the GPU did not answer within the runtime timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A host wait stopped because the interrupt check asked it to (below); the
// GPU work it waited for may still run.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// A CUDA call failed.
class CudaError : public Error {
 public:
  CudaError(cudaError_t code, const std::string& what) : Error(what), code_(code) {}
  cudaError_t code() const { return code_; }

 private:
  cudaError_t code_;
};

// Host waits (for the receive counts, for the GPU) ask this check every few
// milliseconds and throw Interrupted when it returns true. None is set by
// default; the Python module sets one that runs Python's signal handlers, so
// Ctrl-C during a wait raises KeyboardInterrupt. Called from the waiting
// thread; must be cheap and must not throw.
using InterruptCheck = bool (*)();

// Process-wide; nullptr removes it.
void set_interrupt_check(InterruptCheck check);

namespace detail {
[[noreturn]] void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line);
}  // namespace detail

}  // namespace turnout

#define TURNOUT_CUDA_CHECK(expr)                                                       \
  do {                                                                                 \
    cudaError_t turnout_status_ = (expr);                                              \
    if (turnout_status_ != cudaSuccess)                                                \
      ::turnout::detail::throw_cuda_error(turnout_status_, #expr, __FILE__, __LINE__); \
  } while (0)
