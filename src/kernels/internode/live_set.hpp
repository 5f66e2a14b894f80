// Shrink mode across NVL domains: how the ranks of a fresh dispatch agree on
// who takes part when some stop calling (docs/INTERNODE.md "Shrink across
// domains"). The counts step runs two rounds before the forwarder plan:
//
// 1. Every rank meets every rank unmasked when the call started (barrier
//    arrivals, NVL barrier) and judges it under the shrink timeout. Its view
//    V_r holds itself and the ranks that arrived before its deadline.
// 2. Every rank puts V_r to every rank it met in round 1 and waits for the
//    views of the ranks of V_r. A view that does not come fails the call by
//    name: no rank picks a live set from part of the views.
//
// The live set is the intersection of the views of V_r (its own included):
// L_r = AND over q in V_r of V_q. A rank not in its own L_r was left out by
// its peers (it came after some shrink timeout) and fails the call.
//
// Why they agree: say one rank's arrivals land at all its peers at once, and
// rank q sees rank z iff z arrived before q's deadline w_q + T (w_q: when q
// started to wait). Let q* be the rank that started to wait first. Every rank
// sees q* (it arrived before it waited, so before anyone's deadline), and
// every view holds V_{q*} (what arrived before q*'s deadline arrived before
// every later one). So every L_r is exactly V_{q*}. A rank that stops
// calling arrives for nobody and is in no view. Survivors can disagree only if
// some rank's arrivals land at two peers more than a shrink timeout apart and
// the later one decides a view that not every survivor reads (the view of a
// rank that was itself late for some): see the CPU tests.
//
// Shared by the kernels (notify.cuh) and the CPU tests: no CUDA header,
// __host__ __device__ only under nvcc.
#pragma once

#include <cstdint>

#include "kernels/internode/forwarders.hpp"

#if defined(__CUDACC__)
#define TURNOUT_LIVE_SET_HD __host__ __device__
#else
#define TURNOUT_LIVE_SET_HD
#endif

namespace turnout::kernels::internode {

// Word w of L_me. `own`: this rank's view (rank_set_words(num_ranks) words);
// `views`: [num_ranks][words], row q the view q sent, read only for q in
// `own` other than `me`.
TURNOUT_LIVE_SET_HD inline uint32_t agreed_live_word(const uint32_t* own, const uint32_t* views, int num_ranks, int me,
                                                     int w) {
  const int words = rank_set_words(num_ranks);
  uint32_t bits = own[w];
  for (int q = 0; q < num_ranks; ++q)
    if (q != me && rank_in_set(own, q)) bits &= views[static_cast<int64_t>(q) * words + w];
  return bits;
}

// Where `me` is not in its own live set `agreed`: the first rank of it whose
// view left `me` out (a survivor, not another late rank), or -1.
TURNOUT_LIVE_SET_HD inline int left_out_by(const uint32_t* agreed, const uint32_t* views, int num_ranks, int me) {
  const int words = rank_set_words(num_ranks);
  for (int q = 0; q < num_ranks; ++q)
    if (q != me && rank_in_set(agreed, q) && !rank_in_set(views + static_cast<int64_t>(q) * words, me)) return q;
  return -1;
}

}  // namespace turnout::kernels::internode

#undef TURNOUT_LIVE_SET_HD
