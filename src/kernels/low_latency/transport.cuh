// How low-latency kernels reach a peer: put data, then signal. Today peers
// are GPUs of this host, reached by stores through NVLink (peer memory mapped
// by CUDA IPC); ranks on other hosts would implement the same calls with
// NVSHMEM puts, leaving the kernels as they are.
#pragma once

#include <cstdint>

#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"

namespace turnout::kernels::low_latency {

struct NvlinkTransport {
  void* const* regions;  // every rank's low-latency region (the block's copy in shared memory)
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
  // One 8-byte word that the reader sees whole or not at all: data and its
  // call number together need no signal.
  __device__ __forceinline__ void put_tagged(int peer, int64_t offset, uint64_t v) const {
    device::store_relaxed_sys(reinterpret_cast<uint64_t*>(remote(peer, offset)), v);
  }
  // A count the peer reads once the senders have arrived.
  __device__ __forceinline__ void add(int peer, int64_t offset, int32_t v) const {
    device::red_add_relaxed_sys(reinterpret_cast<int32_t*>(remote(peer, offset)), v);
  }
  // Adds to the peer's arrival counter at `offset`: a peer that reads the sum
  // with an acquire load sees every put of this block made before it (the
  // block's threads meet at a barrier first).
  __device__ __forceinline__ void arrive(int peer, int64_t offset, uint32_t v) const {
    device::red_add_release_sys(reinterpret_cast<uint32_t*>(remote(peer, offset)), v);
  }
};

}  // namespace turnout::kernels::low_latency
