// 16-byte loads and stores with the cache behaviour each side of a transfer
// wants, a warp-wide row copy built on them, and named barriers for warp groups.
#pragma once

#include <cstdint>

namespace turnout::device {

// Loads are not volatile: the compiler may batch them, which is what keeps
// enough bytes in flight. They cannot move above the acquire that made the
// data visible, whose asm clobbers memory.

// Read-only input of this kernel (the caller's tensors): the non-coherent path.
__device__ __forceinline__ int4 load_input_16(const void* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Written by another GPU during this kernel: from L2, never from a possibly
// stale L1 line.
__device__ __forceinline__ int4 load_shared_16(const void* p) { return __ldcg(static_cast<const int4*>(p)); }

__device__ __forceinline__ void store_16(void* p, const int4& v) { __stcg(static_cast<int4*>(p), v); }

// One warp copies n16 16-byte words; eight loads are in flight per lane before
// their stores, so a lane does not wait out one round trip per word.
template <bool kSrcIsShared>
__device__ __forceinline__ void warp_copy_16(void* dst, const void* src, int n16, int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  constexpr int kUnroll = 8;
  int i = lane;
  for (; i + 32 * (kUnroll - 1) < n16; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = kSrcIsShared ? load_shared_16(s + i + 32 * u) : load_input_16(s + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store_16(d + i + 32 * u, v[u]);
  }
  for (; i < n16; i += 32) store_16(d + i, kSrcIsShared ? load_shared_16(s + i) : load_input_16(s + i));
}

// A barrier for `threads` threads (whole warps) of the block; ids 1..15 (0 is
// __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ int32_t load_volatile(const int32_t* p) { return *static_cast<const volatile int32_t*>(p); }

}  // namespace turnout::device
