// Dispatch's landing area: past the floor, its parts apart and aligned, and
// none where the buffer cannot hold every part.
#include "kernels/intranode/landing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>

namespace turnout {
namespace {

using kernels::dispatch_landing;

TEST(DispatchLanding, PartsLieApartPastTheFloor) {
  const int64_t rows = 4 * 4096, cap = 1'000'000'000;
  const int row_bytes = 7168, scales = 56, topk = 8;
  const auto l = dispatch_landing(cap, rows, row_bytes, scales, topk);
  ASSERT_GE(l.x, kernels::kStageFloor);
  std::pair<int64_t, int64_t> parts[] = {{l.x, l.x + rows * row_bytes},
                                         {l.scales, l.scales + rows * scales * 4},
                                         {l.topk_idx, l.topk_idx + rows * topk * 8},
                                         {l.weights, l.weights + rows * topk * 4},
                                         {l.src_idx, l.src_idx + rows * 4}};
  std::sort(std::begin(parts), std::end(parts));
  for (size_t i = 0; i + 1 < std::size(parts); ++i) EXPECT_LE(parts[i].second, parts[i + 1].first) << i;
  for (const auto& part : parts) EXPECT_EQ(part.first % 128, 0);
  EXPECT_LE(parts[std::size(parts) - 1].second, cap);
}

TEST(DispatchLanding, NoRoomMeansTheRings) {
  const int64_t rows = 4 * 4096;
  const auto fits = dispatch_landing(1'000'000'000, rows, 14336, 0, 8);
  ASSERT_GE(fits.x, 0);
  const int64_t end = fits.src_idx + rows * 4;
  EXPECT_GE(dispatch_landing(end, rows, 14336, 0, 8).x, 0);
  EXPECT_LT(dispatch_landing(end - 1, rows, 14336, 0, 8).x, 0);
  EXPECT_LT(dispatch_landing(1 << 20, 1, 16, 0, 0).x, 0);
  EXPECT_GE(dispatch_landing((1 << 20) + 1024, 0, 16, 0, 0).x, 0);
}

}  // namespace
}  // namespace turnout
