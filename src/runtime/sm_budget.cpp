#include "runtime/sm_budget.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "turnout/error.hpp"

namespace turnout {

int ranks_on_gpu(std::span<const RankGpu> ranks, int i) {
  return static_cast<int>(
      std::count_if(ranks.begin(), ranks.end(), [&](const RankGpu& r) { return r.uuid == ranks[i].uuid; }));
}

int sm_budget(std::span<const RankGpu> ranks) {
  int budget = -1;
  for (int i = 0; i < static_cast<int>(ranks.size()); ++i) {
    const int share = ranks[i].sms_are_share ? ranks[i].sms : ranks[i].sms / ranks_on_gpu(ranks, i);
    budget = budget < 0 ? share : std::min(budget, share);
  }
  return std::max(2, budget / 2 * 2);
}

RankGpu local_rank_gpu(int device) {
  RankGpu mine;
  cudaDeviceProp prop{};
  TURNOUT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  static_assert(sizeof(prop.uuid.bytes) == sizeof(mine.uuid));
  std::memcpy(mine.uuid.data(), prop.uuid.bytes, sizeof(mine.uuid));
  TURNOUT_CUDA_CHECK(cudaDeviceGetAttribute(&mine.sms, cudaDevAttrMultiProcessorCount, device));
  const char* cap = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  mine.sms_are_share = cap && *cap ? 1 : 0;
  return mine;
}

}  // namespace turnout
