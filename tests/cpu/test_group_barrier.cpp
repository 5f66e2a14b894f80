// The low-latency group barrier's state and arguments
// (kernels/low_latency/group_barrier.hpp): a word per rank of the largest
// group in each of its arrays, page-sized so that the symmetric allocation it
// ends keeps its alignment; a plain barrier unless destroy asks for a vote.
#include <gtest/gtest.h>

#include <cstddef>

#include "kernels/low_latency/group_barrier.hpp"
#include "kernels/low_latency/region.hpp"

namespace turnout {
namespace {

namespace ll = kernels::low_latency;

TEST(GroupBarrier, AreaHoldsAWordPerRankOfTheLargestGroup) {
  EXPECT_GE(static_cast<size_t>(ll::kBarrierAreaBytes), sizeof(ll::BarrierArea));
  EXPECT_EQ(ll::kBarrierAreaBytes % 4096, 0);
  const size_t per_rank = sizeof(uint32_t) * ll::kMaxGroupRanks;
  EXPECT_EQ(offsetof(ll::BarrierArea, epochs), per_rank);
  EXPECT_EQ(offsetof(ll::BarrierArea, leaving_alone), 2 * per_rank);
  EXPECT_EQ(sizeof(ll::BarrierArea), 3 * per_rank);
}

TEST(GroupBarrier, PlainBarrierByDefault) {
  const ll::BarrierArgs args;
  EXPECT_EQ(args.area, 0);
  EXPECT_EQ(args.leave_verdict, nullptr);
}

}  // namespace
}  // namespace turnout
