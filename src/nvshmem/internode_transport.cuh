// The internode kernels' network transport on NVSHMEM (the NetTransport of
// kernels/internode/transport.cuh): a far peer is its PE (its global rank),
// and every write lands at the offset it has in this rank's network region,
// which is symmetric memory.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

namespace turnout::nvshmem {

struct NvshmemNetTransport {
  char* base;  // this rank's network region

  __device__ __forceinline__ char* local() const { return base; }
  __device__ __forceinline__ void put_warp(int pe, int64_t offset, const void* source, int64_t bytes) const {
    nvshmemx_putmem_nbi_warp(base + offset, source, static_cast<size_t>(bytes), pe);
  }
  __device__ __forceinline__ void arrive(int pe, int64_t offset, uint32_t v) const {
    nvshmem_fence();
    nvshmem_uint32_atomic_add(reinterpret_cast<uint32_t*>(base + offset), v, pe);
  }
  __device__ __forceinline__ void add(int pe, int64_t offset, int32_t v) const {
    nvshmem_int32_atomic_add(reinterpret_cast<int32_t*>(base + offset), v, pe);
  }
  __device__ __forceinline__ void quiet() const { nvshmem_quiet(); }
};

}  // namespace turnout::nvshmem
