// Owners of CUDA resources. Each frees what it holds exactly once, so an
// exception thrown half-way through building a Buffer leaks nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

namespace turnout {

template <typename Handle, typename Traits>
class CudaResource {
 public:
  CudaResource() = default;
  explicit CudaResource(Handle h) : h_(h) {}
  ~CudaResource() { reset(); }
  CudaResource(const CudaResource&) = delete;
  CudaResource& operator=(const CudaResource&) = delete;
  CudaResource(CudaResource&& o) noexcept : h_(std::exchange(o.h_, Handle{})) {}
  CudaResource& operator=(CudaResource&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, Handle{});
    }
    return *this;
  }
  Handle get() const { return h_; }
  explicit operator bool() const { return h_ != Handle{}; }
  void reset() {
    if (h_ != Handle{}) Traits::release(std::exchange(h_, Handle{}));
  }

 private:
  Handle h_{};
};

struct DeviceMemoryTraits {
  static void release(void* p) { cudaFree(p); }
};
struct HostMemoryTraits {
  static void release(void* p) { cudaFreeHost(p); }
};
struct StreamTraits {
  static void release(cudaStream_t s) { cudaStreamDestroy(s); }
};
struct EventTraits {
  static void release(cudaEvent_t e) { cudaEventDestroy(e); }
};
struct IpcMappingTraits {
  static void release(void* p) { cudaIpcCloseMemHandle(p); }
};
struct GraphTraits {
  static void release(cudaGraph_t g) { cudaGraphDestroy(g); }
};
struct GraphExecTraits {
  static void release(cudaGraphExec_t g) { cudaGraphExecDestroy(g); }
};

using DeviceMemory = CudaResource<void*, DeviceMemoryTraits>;
using HostMemory = CudaResource<void*, HostMemoryTraits>;
using Stream = CudaResource<cudaStream_t, StreamTraits>;
using Event = CudaResource<cudaEvent_t, EventTraits>;
using IpcMapping = CudaResource<void*, IpcMappingTraits>;
using Graph = CudaResource<cudaGraph_t, GraphTraits>;
using GraphExec = CudaResource<cudaGraphExec_t, GraphExecTraits>;

DeviceMemory allocate_device(size_t bytes);
// Pinned host memory the GPU can read and write (cudaHostAllocMapped).
HostMemory allocate_host_mapped(size_t bytes);
// Non-blocking, highest priority: communication should not queue behind compute.
Stream create_comm_stream();
Event create_event(bool timing = false);

}  // namespace turnout
