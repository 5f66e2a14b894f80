// How low-latency kernels reach a peer. The kernels are templates on a
// transport with these members:
//
//   kReachesFar      whether any peer may be out of load/store reach
//   local()          this rank's own region (its counters, what peers wrote)
//   direct(peer)     a peer's region as a pointer to store through (near peers)
//   is_far(peer)     whether only a network put reaches the peer
//   put_16           one 16-byte word to a near peer
//   put_tagged       one 8-byte word the reader sees whole or not at all
//   set_word         one 4-byte word (a flag or a count)
//   add              adds to a count the peer reads once the senders arrived
//   set_bits         ors bits into a word the peer reads once the senders arrived
//   arrive           adds to an arrival counter: a peer that reads the sum
//                    with an acquire load sees every put of the block before
//   put_warp         (far peers) a warp's put of bytes staged in this rank's
//                    own region to the same offsets' peer region
//
// NvlinkTransport reaches every peer by stores through NVLink (peer memory
// mapped by CUDA VMM or IPC), so a kernel instantiated on it has no network
// path at all. The NVSHMEM transport (src/nvshmem/) reaches the peers of its
// NVL domain the same way and the others by NVSHMEM puts.
#pragma once

#include <cstdint>

#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/launch.hpp"

namespace turnout::kernels::low_latency {

struct NvlinkTransport {
  static constexpr bool kReachesFar = false;

  void* const* regions;  // every rank's low-latency region (the block's copy in shared memory)
  int rank;

  // `table`: group.regions, or the block's shared copy of it.
  __device__ static NvlinkTransport in_block(void* const* table, const Group& group) { return {table, group.rank}; }

  __device__ __forceinline__ char* local() const { return static_cast<char*>(regions[rank]); }
  __device__ __forceinline__ char* direct(int peer) const { return static_cast<char*>(regions[peer]); }
  __device__ __forceinline__ bool is_far(int) const { return false; }
  __device__ __forceinline__ char* remote(int peer, int64_t offset) const { return direct(peer) + offset; }

  __device__ __forceinline__ void put_16(int peer, int64_t offset, const int4& v) const {
    device::store_16(remote(peer, offset), v);
  }
  __device__ __forceinline__ void put_tagged(int peer, int64_t offset, uint64_t v) const {
    device::store_relaxed_sys(reinterpret_cast<uint64_t*>(remote(peer, offset)), v);
  }
  __device__ __forceinline__ void set_word(int peer, int64_t offset, uint32_t v) const {
    *reinterpret_cast<volatile uint32_t*>(remote(peer, offset)) = v;
  }
  __device__ __forceinline__ void add(int peer, int64_t offset, int32_t v) const {
    device::red_add_relaxed_sys(reinterpret_cast<int32_t*>(remote(peer, offset)), v);
  }
  __device__ __forceinline__ void set_bits(int peer, int64_t offset, uint32_t bits) const {
    device::red_or_relaxed_sys(reinterpret_cast<uint32_t*>(remote(peer, offset)), bits);
  }
  // The block's threads meet at a barrier before one of them arrives.
  __device__ __forceinline__ void arrive(int peer, int64_t offset, uint32_t v) const {
    device::red_add_release_sys(reinterpret_cast<uint32_t*>(remote(peer, offset)), v);
  }
  // Never called: no peer is far.
  __device__ __forceinline__ void put_warp(int, int64_t, const void*, int64_t) const { __trap(); }
};

// Groups up to this size copy the region table into each block's shared
// memory (`table`, this many entries); larger ones read it from global memory.
inline constexpr int kSharedRegionTable = 64;

template <class Transport>
__device__ __forceinline__ Transport block_transport(const Group& group, void** table) {
  if (group.num_ranks > kSharedRegionTable) return Transport::in_block(group.regions, group);
  const bool by_value = group.num_ranks <= kRegionsByValue;
  for (int i = static_cast<int>(threadIdx.x); i < group.num_ranks; i += static_cast<int>(blockDim.x))
    table[i] = by_value ? group.regions_by_value[i] : group.regions[i];
  __syncthreads();
  return Transport::in_block(table, group);
}

}  // namespace turnout::kernels::low_latency
