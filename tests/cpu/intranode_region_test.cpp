// The intranode buffer region: its parts do not overlap, and the size hint of
// a config covers every call made with it (dispatch in BF16 and FP8, combine).
#include <gtest/gtest.h>

#include "kernels/intranode/region.hpp"
#include "turnout/config.hpp"

namespace turnout {
namespace {

using kernels::IntranodeRegion;

TEST(IntranodeRegion, PartsDoNotOverlap) {
  const IntranodeRegion r = kernels::make_intranode_region(8, 12, 32, 256, 14848);
  // Each part as [begin, end); every pair must be disjoint.
  const int64_t R = 8, C = 12, L = 32;
  const std::pair<int64_t, int64_t> parts[] = {{r.matrix, r.matrix + R * R * 4},
                                               {r.source_info, r.source_info + R * 16},
                                               {r.channel_start, r.channel_start + R * (C + 1) * 4},
                                               {r.tails, r.tails + C * R * 4},
                                               {r.heads, r.heads + C * R * 4},
                                               {r.status, r.status + 4},
                                               {r.live, r.live + 4},
                                               {r.pull, r.pull + 4},
                                               {r.landed, r.landed + R * 4},
                                               {r.expert_counts, r.expert_counts + R * L * 4},
                                               {r.rings, r.total}};
  for (size_t i = 0; i < std::size(parts); ++i)
    for (size_t j = i + 1; j < std::size(parts); ++j)
      EXPECT_TRUE(parts[i].second <= parts[j].first || parts[j].second <= parts[i].first) << i << " and " << j;
  EXPECT_EQ(r.ring(11, 7) + 256 * int64_t(14848), r.total);
  EXPECT_LE(r.expert_counts + R * L * 4, kernels::kIntranodeMetaBytes);
}

TEST(IntranodeRegion, SizeHintCoversEveryCall) {
  for (int hidden : {1024, 2048, 4096, 7168}) {
    for (int ranks = 2; ranks <= 8; ++ranks) {
      for (int sms : {2, 12, 20, 24, 32}) {
        const Config config(sms, 8, 256);
        const size_t hint = config.get_nvl_buffer_size_hint(size_t(hidden) * 2, ranks);
        const auto bf16 = kernels::make_dispatch_slot(hidden * 2, 0, kMaxTopk);
        const auto fp8 = kernels::make_dispatch_slot(hidden, hidden / 128, kMaxTopk);
        const auto back = kernels::make_combine_slot(hidden, kMaxTopk);
        for (int parts : {bf16.bytes, fp8.bytes, back.bytes}) {
          const int slot = kernels::ring_slot_bytes(parts);
          const auto r = kernels::make_intranode_region(ranks, sms / 2, 1024 / ranks, 256, slot);
          EXPECT_LE(static_cast<size_t>(r.total), hint)
              << "hidden " << hidden << ", " << ranks << " ranks, " << sms << " SMs, slot " << slot;
        }
      }
    }
  }
}

TEST(IntranodeRegion, SlotPartsAreAligned) {
  const auto s = kernels::make_dispatch_slot(7168, 56, 8);
  EXPECT_EQ(s.scales, 7168);
  EXPECT_EQ(s.topk, 7168 + 224);
  EXPECT_EQ(s.weights, s.topk + 32);
  EXPECT_EQ(s.src, s.weights + 32);
  EXPECT_EQ(s.bytes % 16, 0);
  const auto c = kernels::make_combine_slot(7168, 6);
  EXPECT_EQ(c.weights, 14336);
  EXPECT_EQ(c.bytes, 14336 + 32);
}

}  // namespace
}  // namespace turnout
