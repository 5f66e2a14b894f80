// How low-latency kernels reach a peer: put data, then signal. Today peers
// are GPUs of this host and both are plain stores through NVLink (peer
// memory mapped by CUDA IPC); ranks on other hosts would implement the same
// three calls with NVSHMEM puts, leaving the kernels as they are.
#pragma once

#include <cstdint>

#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"

namespace turnout::kernels::low_latency {

struct NvlinkTransport {
  void* const* regions;  // device table: every rank's low-latency region
  int rank;

  // This rank's own region (its counters, and what peers wrote to it).
  __device__ __forceinline__ char* local() const { return static_cast<char*>(regions[rank]); }
  // Where a put to `peer` at `offset` lands, for writes built in place.
  __device__ __forceinline__ char* remote(int peer, int64_t offset) const {
    return static_cast<char*>(regions[peer]) + offset;
  }
  // One 16-byte word of data.
  __device__ __forceinline__ void put_16(int peer, int64_t offset, const int4& v) const {
    device::store_16(remote(peer, offset), v);
  }
  // Makes this thread's puts visible to every peer before any signal that
  // follows it (in this thread, or in one that synchronized with it).
  __device__ __forceinline__ static void fence() { __threadfence_system(); }
  // Publishes `value` at `offset` of `peer`'s region: a peer that reads it
  // with an acquire load sees every put fenced before it.
  __device__ __forceinline__ void signal(int peer, int64_t offset, uint32_t value) const {
    device::store_release_sys(reinterpret_cast<uint32_t*>(remote(peer, offset)), value);
  }
};

}  // namespace turnout::kernels::low_latency
