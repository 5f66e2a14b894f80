// Step times of the low-latency kernels, for finding where a call's time
// goes. Built only with the CMake option TURNOUT_LL_STAMPS: thread 0 of each
// block notes its SM clock at each step and, at the block's end, prints one
// line (`scripts/low_latency_timeline.py --stamps` reads them). Without the
// option every function here is empty, so the kernels are unchanged.
//
// A line: "turnout-stamps OP RANK CALL BLOCK PHASES START_NS END_NS" and then,
// for steps 1 to kStampSteps - 1, the clock cycles from step 0 (-1: not
// reached). START_NS and END_NS are the global timer at steps 0 and the last,
// so that blocks line up and cycles convert to time.
#pragma once

#include <cstdint>

#ifdef TURNOUT_LL_STAMPS
#include <cstdio>

#include "kernels/device/memory_order.cuh"
#endif

namespace turnout::kernels::low_latency {
namespace {

inline constexpr int kStampSteps = 12;

#ifdef TURNOUT_LL_STAMPS
__shared__ long long stamp_clock[kStampSteps];
__shared__ uint64_t stamp_start_ns;
#endif

// Step 0, at the kernel's start: clears the block's record.
__device__ __forceinline__ void stamp_start() {
#ifdef TURNOUT_LL_STAMPS
  if (threadIdx.x != 0) return;
  for (int i = 1; i < kStampSteps; ++i) stamp_clock[i] = -1;
  stamp_start_ns = device::global_timer_ns();
  stamp_clock[0] = clock64();
#endif
}

// Step `step` reached (the last time it is, where a block reaches it more
// than once); `first` keeps the first time instead. `after` is a value the
// step waits for (a load's result), so that the stamp follows its arrival.
template <typename T = int>
__device__ __forceinline__ void stamp(int step, bool first = false, T after = T{}) {
#ifdef TURNOUT_LL_STAMPS
  if (threadIdx.x != 0) return;
  asm volatile("" ::"l"(static_cast<long long>(after)));
  if (!first || stamp_clock[step] < 0) stamp_clock[step] = clock64();
#else
  (void)step;
  (void)first;
  (void)after;
#endif
}

// The block's line, at its end (the last step is stamped here).
__device__ __forceinline__ void print_stamps(const char* op, int rank, uint64_t call, int phases) {
#ifdef TURNOUT_LL_STAMPS
  if (threadIdx.x != 0) return;
  stamp_clock[kStampSteps - 1] = clock64();
  const uint64_t end_ns = device::global_timer_ns();
  long long d[kStampSteps];
  for (int i = 1; i < kStampSteps; ++i) d[i] = stamp_clock[i] < 0 ? -1 : stamp_clock[i] - stamp_clock[0];
  static_assert(kStampSteps == 12, "the line's format names eleven steps");
  printf("turnout-stamps %s %d %llu %d %d %llu %llu %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\n", op, rank,
         static_cast<unsigned long long>(call), static_cast<int>(blockIdx.x), phases,
         static_cast<unsigned long long>(stamp_start_ns), static_cast<unsigned long long>(end_ns), d[1], d[2], d[3],
         d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11]);
#else
  (void)op;
  (void)rank;
  (void)call;
  (void)phases;
#endif
}

}  // namespace
}  // namespace turnout::kernels::low_latency
