// How internode kernels reach the rank of their local index in another NVL
// domain (the only far peers they have): through a transport, so that the
// kernels are templates the core never instantiates and libturnout_nvshmem.so
// instantiates on NVSHMEM (src/nvshmem/internode_transport.cuh). Near peers
// (this domain) are plain stores through the peer table. A far peer is named
// by its global rank (NVSHMEM's PE), and every far write lands at the offset
// it has in this rank's own network region (symmetric memory).
#pragma once

#include <concepts>
#include <cstdint>

#include "kernels/internode/region.hpp"

namespace turnout::kernels::internode {

template <class T>
concept NetTransport =
    requires(const T t, int pe, int64_t offset, const void* source, int64_t bytes, uint32_t v, int32_t delta) {
      // This rank's network region.
      { t.local() } -> std::same_as<char*>;
      // A warp's non-blocking put of bytes in this rank's region (`source`) to
      // the peer's at `offset`; the next arrive orders it.
      t.put_warp(pe, offset, source, bytes);
      // Fence, then an atomic add the reader acquires: a peer that sees the sum
      // sees every earlier put of this rank to it.
      t.arrive(pe, offset, v);
      // An atomic add with no ordering (credits, barrier counts).
      t.add(pe, offset, delta);
      // Every put and atomic of this thread has completed (before a kernel ends).
      t.quiet();
    };

// Warp-wide: the staged slots [put, placed) of this rank's stage ring
// (c, to) go to the same slots of ring (c, from) at peer `pe` (two puts where
// the run wraps the ring), then one arrive on that ring's tail counts them.
// `put` ends at `placed`.
template <NetTransport T>
__device__ __forceinline__ void put_staged(const T& net, const NetRegion& r, int slot_bytes, int pe, int c, int from,
                                           int to, int& put, int placed, int lane) {
  if (put == placed) return;
  const int count = placed - put, Q = r.shape.net_slots;
  while (put < placed) {
    const int first = put % Q, run = placed - put < Q - first ? placed - put : Q - first;
    net.put_warp(pe, r.recv_slot(c, from, first), net.local() + r.stage_slot(c, to, first),
                 static_cast<int64_t>(run) * slot_bytes);
    put += run;
  }
  __syncwarp();
  if (lane == 0) net.arrive(pe, r.tail(c, from), static_cast<uint32_t>(count));
}

// put_staged for a part of the rings (shrink mode): the part's slots are
// [first, first + Q) of both rings, and its tail word is (c, from, part).
template <NetTransport T>
__device__ __forceinline__ void put_staged_part(const T& net, const NetRegion& r, int slot_bytes, int pe, int c,
                                                int from, int to, int part, int first_slot, int Q, int& put, int placed,
                                                int lane) {
  if (put == placed) return;
  const int count = placed - put;
  while (put < placed) {
    const int first = put % Q, run = placed - put < Q - first ? placed - put : Q - first;
    net.put_warp(pe, r.recv_slot(c, from, first_slot + first), net.local() + r.stage_slot(c, to, first_slot + first),
                 static_cast<int64_t>(run) * slot_bytes);
    put += run;
  }
  __syncwarp();
  if (lane == 0) net.arrive(pe, r.tail(c, from, part), static_cast<uint32_t>(count));
}

}  // namespace turnout::kernels::internode
