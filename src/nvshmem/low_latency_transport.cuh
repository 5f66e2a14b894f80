// The low-latency transport of groups that span NVL domains (or that keep
// NVLink out of low-latency mode): a peer whose region is in load/store reach
// (group.regions[d] set) is reached by stores, like NvlinkTransport; any other
// by NVSHMEM, whose PE numbers are the group's ranks. Every far write lands in
// the peer's region at the offset it has in this rank's own (symmetric
// memory), and NVSHMEM's fence orders this PE's puts and atomics to a peer
// before the arrival that follows them.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/launch.hpp"

namespace turnout::nvshmem {

struct NvshmemTransport {
  static constexpr bool kReachesFar = true;

  void* const* regions;  // group.regions or the block's shared copy of it: null for a far peer
  int rank;

  __device__ static NvshmemTransport in_block(void* const* table, const kernels::low_latency::Group& group) {
    return {table, group.rank};
  }

  __device__ __forceinline__ char* local() const { return static_cast<char*>(regions[rank]); }
  __device__ __forceinline__ char* direct(int peer) const { return static_cast<char*>(regions[peer]); }
  __device__ __forceinline__ char* remote(int peer, int64_t offset) const { return direct(peer) + offset; }
  __device__ __forceinline__ bool is_far(int peer) const { return regions[peer] == nullptr; }
  // The symmetric address of `offset`: this rank's, which names the peer's too.
  template <typename T>
  __device__ __forceinline__ T* symmetric(int64_t offset) const {
    return reinterpret_cast<T*>(local() + offset);
  }

  __device__ __forceinline__ void put_16(int peer, int64_t offset, const int4& v) const {
    ::turnout::device::store_16(remote(peer, offset), v);
  }
  // An atomic set, so that the word lands whole over any transport.
  __device__ __forceinline__ void put_tagged(int peer, int64_t offset, uint64_t v) const {
    if (is_far(peer))
      nvshmem_uint64_atomic_set(symmetric<uint64_t>(offset), v, peer);
    else
      ::turnout::device::store_relaxed_sys(reinterpret_cast<uint64_t*>(remote(peer, offset)), v);
  }
  __device__ __forceinline__ void set_word(int peer, int64_t offset, uint32_t v) const {
    if (is_far(peer))
      nvshmem_uint32_atomic_set(symmetric<uint32_t>(offset), v, peer);
    else
      *reinterpret_cast<volatile uint32_t*>(remote(peer, offset)) = v;
  }
  __device__ __forceinline__ void add(int peer, int64_t offset, int32_t v) const {
    if (is_far(peer))
      nvshmem_int32_atomic_add(symmetric<int32_t>(offset), v, peer);
    else
      ::turnout::device::red_add_relaxed_sys(reinterpret_cast<int32_t*>(remote(peer, offset)), v);
  }
  __device__ __forceinline__ void set_bits(int peer, int64_t offset, uint32_t bits) const {
    if (is_far(peer))
      nvshmem_uint32_atomic_or(symmetric<uint32_t>(offset), bits, peer);
    else
      ::turnout::device::red_or_relaxed_sys(reinterpret_cast<uint32_t*>(remote(peer, offset)), bits);
  }
  // After the block's barrier: the fence puts every earlier put and atomic of
  // this PE to the peer ahead of the arrival.
  __device__ __forceinline__ void arrive(int peer, int64_t offset, uint32_t v) const {
    if (is_far(peer)) {
      nvshmem_fence();
      nvshmem_uint32_atomic_add(symmetric<uint32_t>(offset), v, peer);
    } else {
      ::turnout::device::red_add_release_sys(reinterpret_cast<uint32_t*>(remote(peer, offset)), v);
    }
  }
  // A warp's non-blocking put from this rank's region (`source`, registered
  // memory) to the peer's at `offset`; the next arrival's fence orders it.
  __device__ __forceinline__ void put_warp(int peer, int64_t offset, const void* source, int64_t bytes) const {
    nvshmemx_putmem_nbi_warp(symmetric<void>(offset), source, static_cast<size_t>(bytes), peer);
  }
};

}  // namespace turnout::nvshmem
