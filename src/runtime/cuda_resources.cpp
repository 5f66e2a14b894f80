#include "runtime/cuda_resources.hpp"

#include "turnout/error.hpp"

namespace turnout {

DeviceMemory allocate_device(size_t bytes) {
  void* p = nullptr;
  TURNOUT_CUDA_CHECK(cudaMalloc(&p, bytes));
  return DeviceMemory(p);
}

HostMemory allocate_host_mapped(size_t bytes) {
  void* p = nullptr;
  TURNOUT_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  return HostMemory(p);
}

Stream create_comm_stream() {
  int least = 0, greatest = 0;
  TURNOUT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s = nullptr;
  TURNOUT_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  return Stream(s);
}

Event create_event(bool timing) {
  cudaEvent_t e = nullptr;
  TURNOUT_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  return Event(e);
}

}  // namespace turnout
