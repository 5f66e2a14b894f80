// Where the intranode ops keep things in each rank's NVL buffer. Every rank
// computes the same offsets from the same call, so a sender knows where to
// write in its peers' buffers. Shared by the host launchers and the kernels.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

#include "runtime/align.hpp"

namespace turnout::kernels {

// Bytes of the per-call counts area before the rings (the size hints reserve it).
inline constexpr int64_t kIntranodeMetaBytes = 64 * 1024;

// Combine's stages and dispatch's landing areas start no lower than this,
// above the counts words of any call's region (under 200 KB for 8 ranks, 128
// channels and 4096 local experts), which peers write before a call's first
// barrier, while a slower rank may still be reading the stages of the call
// before.
inline constexpr int64_t kStageFloor = 1 << 20;

struct IntranodeRegion {
  int num_ranks = 0;
  int num_channels = 0;
  int num_local_experts = 0;
  int ring_slots = 0;  // Q: tokens one ring holds
  int slot_bytes = 0;
  // Byte offsets; "[s]" rows are written by rank s into every peer's copy.
  int64_t matrix = 0;         // int32 [R][R]: row s = tokens s sends to each rank
  int64_t source_info = 0;    // int32 [R][4]: {num_tokens, num_worst_tokens, input error, combine stage tag} of rank s
  int64_t expert_counts = 0;  // int32 [R][L]: tokens s sends to each of my experts
  int64_t channel_start = 0;  // int32 [R][C+1]: first position of channel c in s's stream to me
  int64_t tails = 0;          // int32 [C][R]: tokens peer r has written into my ring (c, r)
  int64_t heads = 0;          // int32 [C][R]: tokens peer r has consumed of what I sent it
  int64_t status = 0;         // int32: nonzero = the data kernel skips this call (bad input)
  int64_t live = 0;           // int32: bit r = rank r takes part in this call (shrink mode: not masked)
  int64_t pull = 0;           // int32: nonzero = combine's blocks pull from every rank's stage (combine_stage.hpp)
  int64_t landed = 0;         // int32 [R]: blocks of rank s done writing their rows into my landing area
  int64_t rings = 0;          // [C][R][Q] slots: ring (c, r) is written by peer r
  int64_t total = 0;

  __host__ __device__ int64_t ring(int channel, int peer) const {
    return rings + (static_cast<int64_t>(channel) * num_ranks + peer) * ring_slots * slot_bytes;
  }
  __host__ __device__ int64_t tail(int channel, int peer) const {
    return tails + (static_cast<int64_t>(channel) * num_ranks + peer) * 4;
  }
  __host__ __device__ int64_t head(int channel, int peer) const {
    return heads + (static_cast<int64_t>(channel) * num_ranks + peer) * 4;
  }
};

inline IntranodeRegion make_intranode_region(int num_ranks, int num_channels, int num_local_experts, int ring_slots,
                                             int slot_bytes) {
  IntranodeRegion r;
  r.num_ranks = num_ranks;
  r.num_channels = num_channels;
  r.num_local_experts = num_local_experts;
  r.ring_slots = ring_slots;
  r.slot_bytes = slot_bytes;
  const int64_t R = num_ranks, C = num_channels, L = num_local_experts;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  r.matrix = take(R * R * 4);
  r.source_info = take(R * 4 * 4);
  r.channel_start = take(R * (C + 1) * 4);
  r.tails = take(C * R * 4);
  r.heads = take(C * R * 4);
  r.status = take(4);
  r.live = take(4);
  r.pull = take(4);
  r.landed = take(R * 4);
  // Last, so no other offset depends on the expert count.
  r.expert_counts = take(R * L * 4);
  // The meta area has a fixed size so the size hints can cover it; past it
  // only the rings grow with the call.
  r.rings = at > kIntranodeMetaBytes ? at : kIntranodeMetaBytes;
  r.total = r.rings + C * R * ring_slots * static_cast<int64_t>(slot_bytes);
  return r;
}

// Intranode ring slots take whole 128-byte lines, so that every row crosses
// NVLink as whole lines (a 14416-byte BF16 dispatch slot left seven rows in
// eight starting mid-line).
inline constexpr int kRingSlotAlign = 128;

// A ring slot for a token whose parts take `parts_bytes`.
inline int ring_slot_bytes(int64_t parts_bytes) {
  return static_cast<int>(align_up(parts_bytes, kRingSlotAlign));
}

// One dispatched token in a ring slot: row, scales, top-k (local ids as int32),
// weights, source index. Each part 16-byte aligned.
struct DispatchSlot {
  int row_bytes = 0;
  int scales = 0;
  int topk = 0;
  int weights = 0;
  int src = 0;
  int bytes = 0;
};

inline DispatchSlot make_dispatch_slot(int row_bytes, int num_scales, int num_topk) {
  DispatchSlot s;
  s.row_bytes = row_bytes;
  s.scales = static_cast<int>(align_up(row_bytes, 16));
  s.topk = s.scales + static_cast<int>(align_up(int64_t(num_scales) * 4, 16));
  s.weights = s.topk + static_cast<int>(align_up(int64_t(num_topk) * 4, 16));
  s.src = s.weights + static_cast<int>(align_up(int64_t(num_topk) * 4, 16));
  s.bytes = s.src + 16;
  return s;
}

// One expert-output row on its way back: bf16 row, then the top-k weights.
struct CombineSlot {
  int row_bytes = 0;
  int weights = 0;
  int bytes = 0;
};

inline CombineSlot make_combine_slot(int hidden, int num_topk) {
  CombineSlot s;
  s.row_bytes = hidden * 2;
  s.weights = static_cast<int>(align_up(s.row_bytes, 16));
  s.bytes = s.weights + static_cast<int>(align_up(int64_t(num_topk) * 4, 16));
  return s;
}

}  // namespace turnout::kernels
