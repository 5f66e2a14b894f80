// Reads the device's free memory on a helper thread. The driver's query
// (cudaMemGetInfo) costs 10-29 us of host time; a dispatch asks for it when
// the call begins and takes the reading after its counts launch, so the
// query runs beside the argument checks instead of in line with them.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>

#include <cuda_runtime_api.h>

namespace turnout {

class FreeMemoryProbe {
 public:
  explicit FreeMemoryProbe(int device) : device_(device) {}
  ~FreeMemoryProbe();
  FreeMemoryProbe(const FreeMemoryProbe&) = delete;
  FreeMemoryProbe& operator=(const FreeMemoryProbe&) = delete;

  // Starts a reading; one asked for before and not yet taken is dropped.
  void request();
  // The reading of the last request, waiting for it if the query still runs;
  // with none pending, reads now on the calling thread. A reading is taken
  // once, so it is never older than the request that made it.
  size_t take();

 private:
  void run();

  int device_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool requested_ = false;  // a request the thread has not started on
  bool pending_ = false;    // a request not yet taken
  bool ready_ = false;      // its reading is in free_bytes_ / status_
  bool stop_ = false;
  size_t free_bytes_ = 0;
  cudaError_t status_ = cudaSuccess;
  std::thread thread_;
};

}  // namespace turnout
