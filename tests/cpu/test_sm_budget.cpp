// The SM budget of ranks that share GPUs: every rank's blocks must fit at once.
#include <gtest/gtest.h>

#include <vector>

#include "runtime/sm_budget.hpp"

namespace turnout {
namespace {

RankGpu on_gpu(uint8_t id, int sms, bool capped = false) {
  RankGpu r;
  r.uuid[0] = id;
  r.uuid[15] = static_cast<uint8_t>(id * 7 + 1);
  r.sms = sms;
  r.sms_are_share = capped ? 1 : 0;
  return r;
}

TEST(SmBudget, OneRankPerGpuGetsTheWholeGpuRoundedToEven) {
  const std::vector<RankGpu> ranks{on_gpu(0, 132), on_gpu(1, 132), on_gpu(2, 132), on_gpu(3, 132)};
  EXPECT_EQ(sm_budget(ranks), 132);
  const std::vector<RankGpu> odd{on_gpu(0, 133), on_gpu(1, 133)};
  EXPECT_EQ(sm_budget(odd), 132);
  EXPECT_EQ(ranks_on_gpu(ranks, 2), 1);
}

TEST(SmBudget, RanksOnOneGpuSplitItsSms) {
  for (int n : {2, 3, 4, 8}) {
    std::vector<RankGpu> ranks(n, on_gpu(5, 132));
    const int budget = sm_budget(ranks);
    EXPECT_EQ(budget % 2, 0) << n << " ranks";
    EXPECT_LE(budget * n, 132) << n << " ranks";
    EXPECT_GT((budget + 2) * n, 132) << n << " ranks: the share is the largest even one that fits";
    EXPECT_EQ(ranks_on_gpu(ranks, n - 1), n);
  }
}

TEST(SmBudget, TheMostCrowdedGpuSetsTheBudgetForAll) {
  // Five ranks round-robin over two GPUs: three on GPU 0, two on GPU 1.
  const std::vector<RankGpu> ranks{on_gpu(0, 132), on_gpu(1, 132), on_gpu(0, 132), on_gpu(1, 132), on_gpu(0, 132)};
  EXPECT_EQ(sm_budget(ranks), 44);
  EXPECT_EQ(ranks_on_gpu(ranks, 0), 3);
  EXPECT_EQ(ranks_on_gpu(ranks, 3), 2);
}

TEST(SmBudget, AnMpsCapIsAlreadyTheShare) {
  // With CUDA_MPS_ACTIVE_THREAD_PERCENTAGE the driver reports the capped count.
  const std::vector<RankGpu> ranks(8, on_gpu(9, 16, true));
  EXPECT_EQ(sm_budget(ranks), 16);
  const std::vector<RankGpu> mixed{on_gpu(9, 66, true), on_gpu(9, 132)};
  EXPECT_EQ(sm_budget(mixed), 66);
}

TEST(SmBudget, NeverBelowOneChannel) {
  const std::vector<RankGpu> ranks(8, on_gpu(1, 6));
  EXPECT_EQ(sm_budget(ranks), 2);
}

}  // namespace
}  // namespace turnout
