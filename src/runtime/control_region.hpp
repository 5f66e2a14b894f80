// The head of every rank's NVL allocation: signals the kernels of this library
// exchange. The user-visible buffer starts kControlBytes after it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "turnout/topology.hpp"

namespace turnout {

// Counted per pair, so that a pair that skipped barriers together (shrink
// mode: a masked peer) is still in step when it meets again.
struct ControlRegion {
  uint32_t barrier_arrivals[kMaxNvlRanks];  // [i]: barriers with this rank that NVL peer i has reached, ever
  uint32_t barrier_epochs[kMaxNvlRanks];    // [i]: barriers with peer i this rank has completed
  // A launch of both steps of an intranode op (kernels/intranode/first_block.cuh):
  // its blocks' arrivals (0 between launches) and the barrier's generation.
  uint32_t first_block[2];
};

inline constexpr size_t kControlBytes = 4096;
static_assert(sizeof(ControlRegion) <= kControlBytes);

}  // namespace turnout
