// Device memory through the CUDA virtual memory management API. Its physical
// allocation is reference counted by the driver: a process that imported it
// keeps it alive after the exporter unmaps it, releases it or dies, unlike
// legacy CUDA IPC, where the exporter's exit frees memory others still map.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>

#include "runtime/unique_fd.hpp"

namespace turnout {

// Empty if `device` can allocate VMM memory exportable as a POSIX file
// descriptor, else why not. Throws only when the driver cannot be asked.
std::string vmm_unsupported_reason(int device);

// One mapping of one physical allocation into this process's address space,
// read/write for one device. Owns the mapping, the address range and, for
// memory created here, the allocation handle.
class VmmMemory {
 public:
  VmmMemory() = default;
  ~VmmMemory() { reset(); }
  VmmMemory(const VmmMemory&) = delete;
  VmmMemory& operator=(const VmmMemory&) = delete;
  VmmMemory(VmmMemory&& o) noexcept;
  VmmMemory& operator=(VmmMemory&& o) noexcept;

  // A new allocation on `device` of at least `bytes` (rounded up to the
  // recommended granularity), exportable as a POSIX file descriptor.
  static VmmMemory create(int device, size_t bytes);
  // Maps an allocation of `bytes` (its size() where it was created) that
  // another process exported as `fd`, for `device`. The caller still owns
  // `fd`; the mapping holds its own reference to the memory.
  static VmmMemory import(int fd, size_t bytes, int device);

  // A new file descriptor for the allocation (created memory only).
  UniqueFd export_fd() const;

  void* get() const { return reinterpret_cast<void*>(ptr_); }
  size_t size() const { return size_; }
  // Unmaps; the physical memory goes when its last mapping or handle does.
  void reset() noexcept;

 private:
  // After handle_ and size_ are set: reserves a range aligned to `alignment`,
  // maps the allocation there and lets `location` read and write it.
  void map(size_t alignment, const CUmemLocation& location);

  CUdeviceptr ptr_ = 0;  // nonzero: the range is reserved
  size_t size_ = 0;
  CUmemGenericAllocationHandle handle_ = 0;
  bool owns_handle_ = false;
  bool mapped_ = false;
};

}  // namespace turnout
