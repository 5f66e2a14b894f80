#include "runtime/free_memory_probe.hpp"

#include "turnout/error.hpp"

namespace turnout {

namespace {

// On `device`, whatever device is current.
cudaError_t query_free_bytes(int device, size_t* free_bytes) {
  int current = 0;
  cudaError_t st = cudaGetDevice(&current);
  if (st == cudaSuccess && current != device) st = cudaSetDevice(device);
  if (st != cudaSuccess) return st;
  size_t total = 0;
  st = cudaMemGetInfo(free_bytes, &total);
  if (current != device) {
    const cudaError_t back = cudaSetDevice(current);
    if (st == cudaSuccess) st = back;
  }
  return st;
}

}  // namespace

FreeMemoryProbe::~FreeMemoryProbe() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void FreeMemoryProbe::request() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Started on first use; if that throws, nothing waits for a reading.
    if (!thread_.joinable()) thread_ = std::thread(&FreeMemoryProbe::run, this);
    requested_ = pending_ = true;
    ready_ = false;
  }
  wake_.notify_all();
}

size_t FreeMemoryProbe::take() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!pending_) {
    lock.unlock();
    size_t free_bytes = 0;
    const cudaError_t st = query_free_bytes(device_, &free_bytes);
    if (st != cudaSuccess) detail::throw_cuda_error(st, "cudaMemGetInfo()", __FILE__, __LINE__);
    return free_bytes;
  }
  wake_.wait(lock, [this] { return ready_; });
  pending_ = ready_ = false;
  if (status_ != cudaSuccess)
    detail::throw_cuda_error(status_, "cudaMemGetInfo() on the helper thread", __FILE__, __LINE__);
  return free_bytes_;
}

void FreeMemoryProbe::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return requested_ || stop_; });
    if (stop_) return;
    requested_ = false;
    lock.unlock();
    size_t free_bytes = 0;
    const cudaError_t st = query_free_bytes(device_, &free_bytes);
    lock.lock();
    // A request that came during the query wants a reading taken after it.
    if (requested_) continue;
    free_bytes_ = free_bytes;
    status_ = st;
    ready_ = true;
    wake_.notify_all();
  }
}

}  // namespace turnout
