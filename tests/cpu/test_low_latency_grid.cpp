// The low-latency grid (kernels/low_latency/grid.hpp): the fewest blocks that
// leave no block or warp more items than the whole SM budget would.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/low_latency/grid.hpp"

namespace turnout {
namespace {

namespace ll = kernels::low_latency;

// Items the busiest taker gets when `items` go round-robin over `blocks`
// blocks of `per_block` takers.
int64_t busiest(int64_t items, int per_block, int blocks) {
  const int64_t takers = static_cast<int64_t>(per_block) * blocks;
  return (items + takers - 1) / takers;
}

TEST(LowLatencyGrid, FewestBlocksKeepTheBusiestTakerAsWithTheWholeBudget) {
  for (int per_block : {1, 16}) {
    for (int budget : {2, 4, 16, 32, 66, 78, 114, 132}) {
      for (int64_t items = 1; items <= 4 * per_block * budget + 7; ++items) {
        const int g = ll::fewest_blocks(items, per_block, budget);
        ASSERT_GE(g, 1);
        ASSERT_LE(g, budget);
        ASSERT_EQ(busiest(items, per_block, g), busiest(items, per_block, budget))
            << items << " items, " << per_block << " a block, budget " << budget;
        if (g > 1)
          ASSERT_GT(busiest(items, per_block, g - 1), busiest(items, per_block, budget))
              << items << " items, " << per_block << " a block, budget " << budget << ": " << g - 1 << " would do";
      }
    }
  }
}

TEST(LowLatencyGrid, NoWorkStillLaunchesOneBlock) {
  EXPECT_EQ(ll::fewest_blocks(0, 16, 132), 1);
  EXPECT_EQ(ll::fewest_blocks(500, 16, 1), 1);
  EXPECT_EQ(ll::dispatch_blocks(0, 4, 128, 16, 132), 32);  // the receive's 512 slots
}

TEST(LowLatencyGrid, TheMeasuredShapes) {
  // EP4, 128 tokens, hidden 7168 (14 chunks of 512), 16 warps a block, 132 SMs.
  EXPECT_EQ(ll::dispatch_blocks(128, 4, 128, 16, 132), 128);
  EXPECT_EQ(ll::combine_blocks(128, 4, 128, 14, 16, 132), 112);
  // Ranks sharing a GPU get a share of it, and use all of it.
  EXPECT_EQ(ll::dispatch_blocks(128, 4, 128, 16, 32), 32);
  EXPECT_EQ(ll::combine_blocks(128, 4, 128, 14, 16, 32), 32);
  // More tokens than SMs: two a block, on as few blocks as that takes.
  EXPECT_EQ(ll::dispatch_blocks(256, 4, 256, 16, 132), 128);
  // The receive sets the grid where this rank sends few tokens.
  EXPECT_EQ(ll::dispatch_blocks(3, 8, 128, 16, 132), 64);
  // Combine's send does not shrink with this rank's tokens: 8 * 128 * 14
  // items, 7 a warp on 132 blocks, as on 128.
  EXPECT_EQ(ll::combine_blocks(3, 8, 128, 14, 16, 132), 128);
}

}  // namespace
}  // namespace turnout
