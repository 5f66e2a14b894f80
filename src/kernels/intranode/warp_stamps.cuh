// Where an intranode warp's time goes, for profiling. Built only with the
// CMake option TURNOUT_INTRANODE_STAMPS: lane 0 of each warp adds the SM
// clock's cycles between marks to the part the mark names, in shared memory
// (no registers taken from the copies), and at the warp's end prints one line
// (scripts/intranode_stamps.py reads them). Without the option every member
// is empty, so the kernels are unchanged.
//
// A line: "turnout-intranode-stamps OP ROLE RANK CHANNEL WARP PEER ROWS
// START_NS END_NS C0 C1 C2 C3 C4": the rows the warp moved, the global timer
// at begin() and at print(), and the cycles of each part (part 0 holds what
// no mark named).
#pragma once

#include <cstdint>

#ifdef TURNOUT_INTRANODE_STAMPS
#include <cstdio>

#include "kernels/device/memory_order.cuh"
#endif

namespace turnout::kernels {

// The parts of a warp's time. A sender: its walk (kOther), its waits for ring
// room (kWait), each of its rows' loads and stores issued (kRow), the small
// parts' stores (kSmall), its rounds' ends (barrier and tail release,
// kHandOff). A receiver: waiting for a tail and its group (kWait), copying
// rows out (kRow), handing slots back (barrier and head release, kHandOff).
// A combine reducer, per token: waiting for its rows' tails (kWait), loading,
// summing and storing the rows (kRow), the top-k weights (kSmall), posting its
// progress for the slots' return (kHandOff).
enum StampPart { kOther = 0, kWait = 1, kRow = 2, kSmall = 3, kHandOff = 4, kStampParts = 5 };

namespace {
#ifdef TURNOUT_INTRANODE_STAMPS
inline constexpr int kStampWarps = 32;
__shared__ long long stamp_spent[kStampWarps][kStampParts];
__shared__ long long stamp_last[kStampWarps];
__shared__ uint64_t stamp_start_ns[kStampWarps];
__shared__ int stamp_rows[kStampWarps];
#endif
}  // namespace

struct WarpStamps {
  // At the warp's start: clears its record.
  __device__ static void begin() {
#ifdef TURNOUT_INTRANODE_STAMPS
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0) return;
    for (int k = 0; k < kStampParts; ++k) stamp_spent[w][k] = 0;
    stamp_rows[w] = 0;
    stamp_start_ns[w] = device::global_timer_ns();
    stamp_last[w] = clock64();
#endif
  }
  // The cycles since the last mark (or begin) go to `part`.
  __device__ static void mark(StampPart part) {
#ifdef TURNOUT_INTRANODE_STAMPS
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0) return;
    const long long now = clock64();
    stamp_spent[w][part] += now - stamp_last[w];
    stamp_last[w] = now;
#else
    (void)part;
#endif
  }
  __device__ static void row() {
#ifdef TURNOUT_INTRANODE_STAMPS
    if (threadIdx.x % 32 == 0) ++stamp_rows[threadIdx.x / 32];
#endif
  }
  // The warp's line; what is left since the last mark goes to part 0.
  __device__ static void print(const char* op, const char* role, int rank, int channel, int peer) {
#ifdef TURNOUT_INTRANODE_STAMPS
    mark(kOther);
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0) return;
    const long long* c = stamp_spent[w];
    static_assert(kStampParts == 5, "the line's format names five parts");
    printf("turnout-intranode-stamps %s %s %d %d %d %d %d %llu %llu %lld %lld %lld %lld %lld\n", op, role, rank,
           channel, w, peer, stamp_rows[w], static_cast<unsigned long long>(stamp_start_ns[w]),
           static_cast<unsigned long long>(device::global_timer_ns()), c[0], c[1], c[2], c[3], c[4]);
#else
    (void)op;
    (void)role;
    (void)rank;
    (void)channel;
    (void)peer;
#endif
  }
};

}  // namespace turnout::kernels
