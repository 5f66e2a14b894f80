// Combine's stages: past the rings and the counts words of any call, the two
// stages and their parts apart, and no stage where the buffer has no room.
#include "kernels/intranode/combine_stage.hpp"

#include <gtest/gtest.h>

#include <utility>

#include "kernels/intranode/region.hpp"

namespace turnout {
namespace {

using kernels::combine_stage;
using kernels::CombineStage;

TEST(CombineStage, StagesLieApartPastTheRegion) {
  const auto region = kernels::make_intranode_region(4, 12, 0, 256, 14464);
  const int64_t cap = 1'000'000'000;
  const int row_bytes = 14336, topk = 8;
  const CombineStage s0 = combine_stage(region.total, cap, row_bytes, topk, 0);
  const CombineStage s1 = combine_stage(region.total, cap, row_bytes, topk, 1);
  ASSERT_GE(s0.at, region.total);
  EXPECT_EQ(s0.at % 4096, 0);
  EXPECT_EQ(s0.rows % 128, 0);
  EXPECT_EQ(s0.fit_rows, s1.fit_rows);
  EXPECT_EQ(s0.rows, s1.rows);
  EXPECT_EQ(combine_stage(region.total, cap, row_bytes, topk, 2).at, s0.at);
  // Weights [0, rows), then the rows; stage 0 ends before stage 1 begins.
  EXPECT_LE(int64_t(s0.fit_rows) * topk * 4, s0.rows);
  EXPECT_LE(s0.at + s0.rows + int64_t(s0.fit_rows) * row_bytes, s1.at);
  EXPECT_LE(s1.at + s1.rows + int64_t(s1.fit_rows) * row_bytes, cap);
  // Most of the room is used: 4096 tokens from each of 4 ranks fit twice in 1e9 bytes.
  EXPECT_GE(s0.fit_rows, 4 * 4096);
}

TEST(CombineStage, AboveTheCountsWordsOfAnyCall) {
  // A small combine region: the stages still start past every dispatch's counts words.
  const auto combine = kernels::make_intranode_region(2, 1, 0, 1, 2080);
  const auto dispatch = kernels::make_intranode_region(8, 128, 4096, 1, 14592);
  const CombineStage s = combine_stage(combine.total, 1 << 30, 2048, 8, 0);
  ASSERT_GE(s.at, 0);
  EXPECT_GE(s.at, dispatch.expert_counts + 8 * 4096 * 4);
  EXPECT_GE(s.at, dispatch.channel_start + 8 * 129 * 4);
}

TEST(CombineStage, NoRoomMeansTheRings) {
  const auto region = kernels::make_intranode_region(8, 12, 0, 256, 14464);
  EXPECT_LT(combine_stage(region.total, region.total, 14336, 8, 0).at, 0);
  EXPECT_LT(combine_stage(region.total, region.total + 8192, 14336, 8, 0).at, 0);
  // Room for one row of 14336 bytes and its 8 weights in each stage.
  const CombineStage one = combine_stage(region.total, align_up(region.total, 4096) + 2 * 16384, 14336, 8, 1);
  EXPECT_EQ(one.fit_rows, 1);
  EXPECT_EQ(combine_stage(0, 0, 14336, 8, 0).fit_rows, 0);
}

TEST(CombineStage, GapLeavesOutTheOwnRowsUnlessFewAndInTheMiddle) {
  using kernels::kOwnRowsCopiedBytes;
  using kernels::stage_gap;
  const int64_t row = 14336, n = 4000;
  const int64_t few = kOwnRowsCopiedBytes / row, many = few + 1;
  using Range = std::pair<int64_t, int64_t>;
  auto gap = [](int64_t begin, int64_t count, int64_t rows, int64_t row_bytes) {
    const kernels::StageGap g = stage_gap(begin, count, rows, row_bytes);
    return Range{g.begin, g.count};
  };
  // At an end a rank's rows are one copy either way: its own always stay out.
  EXPECT_EQ(gap(0, few, n, row), Range(0, few));
  EXPECT_EQ(gap(n - few, few, n, row), Range(n - few, few));
  EXPECT_EQ(gap(0, n, n, row), Range(0, n));
  // In the middle: few go along (one copy), more than the bound stay out (two).
  EXPECT_EQ(gap(100, few, n, row), Range(0, 0));
  EXPECT_EQ(gap(100, many, n, row), Range(100, many));
  EXPECT_EQ(gap(1, 1, 3, row), Range(0, 0));
  EXPECT_EQ(gap(100, kOwnRowsCopiedBytes / 4096, n, 4096), Range(0, 0));  // the bound's bytes exactly
  // The bound is of bytes: the same rows of a narrower hidden go along.
  EXPECT_EQ(gap(100, many, n, row / 2), Range(0, 0));
  // No own rows, or none known: nothing left out.
  EXPECT_EQ(gap(100, 0, n, row), Range(0, 0));
  EXPECT_EQ(gap(-1, 0, n, row), Range(0, 0));
}

}  // namespace
}  // namespace turnout
