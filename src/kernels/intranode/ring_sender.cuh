// The sending side of one ring, driven by a warp group: positions are handed
// out round robin to the group's warps; before a round the group waits until
// the receiver has left room for all of it, after the round it publishes the
// tail from its last warp (from the first, combine took 1-6% longer on 4x
// H200). Every warp of the group calls reserve/commit for every position, so
// all reach the same barriers even after a failed wait.
#pragma once

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/intranode/launch.hpp"

namespace turnout::kernels {

struct RingSender {
  char* ring;           // slots in the receiver's buffer
  int32_t* tail;        // in the receiver's buffer
  const int32_t* head;  // in ours, written by the receiver
  int slot_bytes, ring_slots, round, group_warps, warp_in_group, barrier_id, peer_rank;
  WaitSite site;
  int known_head = 0;
  bool ok = true;

  __device__ RingSender(char* ring_, int32_t* tail_, const int32_t* head_, int slot_bytes_, int ring_slots_, int hint,
                        int group_warps_, int warp_in_group_, int barrier_id_, int peer_rank_, WaitSite site_)
      : ring(ring_),
        tail(tail_),
        head(head_),
        slot_bytes(slot_bytes_),
        ring_slots(ring_slots_),
        round(round_size(hint, group_warps_, ring_slots_)),
        group_warps(group_warps_),
        warp_in_group(warp_in_group_),
        barrier_id(barrier_id_),
        peer_rank(peer_rank_),
        site(site_) {}

  // Before position n: at a round's start, wait for room for the whole round.
  __device__ void reserve(int n, const WaitContext& ctx, int lane) {
    if (n % round != 0 || !ok || known_head >= n + round - ring_slots) return;
    if (lane == 0)
      ok = device::bounded_wait(ctx, peer_rank, site, [&] {
        known_head = device::load_acquire_sys(head);
        return known_head >= n + round - ring_slots;
      });
    ok = __shfl_sync(~0u, ok, 0);
    known_head = __shfl_sync(~0u, known_head, 0);
  }
  // Whether this warp fills position n, and where.
  __device__ bool mine(int n) const { return ok && n % group_warps == warp_in_group; }
  __device__ char* slot(int n) const { return ring + static_cast<int64_t>(n % ring_slots) * slot_bytes; }
  // After position n: at a round's end, publish the tail.
  __device__ void commit(int n, int lane) {
    if (n % round == round - 1) publish(n + 1, lane);
  }
  // After the last position: publish a partial round.
  __device__ void finish(int total, int lane) {
    if (total % round != 0) publish(total, lane);
  }

 private:
  __device__ void publish(int count, int lane) {
    device::named_barrier(barrier_id, group_warps * 32);
    if (ok && warp_in_group == group_warps - 1 && lane == 0) device::store_release_sys(tail, count);
  }
};

}  // namespace turnout::kernels
