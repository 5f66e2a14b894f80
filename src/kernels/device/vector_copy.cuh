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
__device__ __forceinline__ int4 load_shared_16(const void* p) {
  return __ldcg(static_cast<const int4*>(p));
}

__device__ __forceinline__ void store_16(void* p, const int4& v) {
  __stcg(static_cast<int4*>(p), v);
}

// Passes of kWords words per lane from word i on, while a whole pass fits
// before `end`: all loads of a pass are in flight before its stores. Returns
// where the passes stopped.
template <bool kSrcIsShared, int kWords>
__device__ __forceinline__ int copy_passes(int4* d, const int4* s, int i, int end) {
  for (; i + 32 * (kWords - 1) < end; i += 32 * kWords) {
    int4 v[kWords];
#pragma unroll
    for (int u = 0; u < kWords; ++u)
      v[u] = kSrcIsShared ? load_shared_16(s + i + 32 * u) : load_input_16(s + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kWords; ++u) store_16(d + i + 32 * u, v[u]);
  }
  return i;
}

// One warp copies n16 16-byte words in passes of eight words per lane. A
// remainder goes a word at a time, one round trip per word (the stores may
// alias the loads, so they cannot be batched). So a copy from the input
// (rows leaving this GPU) uses passes of seven where eight would leave a
// remainder and seven do not, as for 7168-byte rows (448 words): that cut FP8
// dispatch by 9% and combine by 16%. Rows another GPU wrote keep passes of
// eight: seven made BF16 dispatch slower with few SMs.
template <bool kSrcIsShared>
__device__ __forceinline__ void warp_copy_16(void* dst, const void* src, int n16, int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  if (!kSrcIsShared && n16 % 256 != 0 && n16 % 224 == 0) {
    copy_passes<kSrcIsShared, 7>(d, s, lane, n16);
    return;
  }
  for (int i = copy_passes<kSrcIsShared, 8>(d, s, lane, n16); i < n16; i += 32)
    store_16(d + i, kSrcIsShared ? load_shared_16(s + i) : load_input_16(s + i));
}

// As warp_copy_16 from rows another GPU wrote, with the remainder past the
// whole passes in one pass cut short at the row's end instead of a round trip
// per word (448-word FP8 rows: one pass and six such words). Not in
// warp_copy_16 itself: the internode kernels' spills grew with it.
__device__ __forceinline__ void warp_copy_shared_16_cut(void* dst, const void* src, int n16, int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  constexpr int kWords = 8;
  for (int i = lane; i < n16; i += 32 * kWords) {
    int4 v[kWords];
#pragma unroll
    for (int u = 0; u < kWords; ++u)
      if (i + 32 * u < n16) v[u] = load_shared_16(s + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kWords; ++u)
      if (i + 32 * u < n16) store_16(d + i + 32 * u, v[u]);
  }
}

// A barrier for `threads` threads (whole warps) of the block; ids 1..15 (0 is
// __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ int32_t load_volatile(const int32_t* p) {
  return *static_cast<const volatile int32_t*>(p);
}

}  // namespace turnout::device
