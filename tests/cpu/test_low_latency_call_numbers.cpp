// Low-latency call numbers (kernels/low_latency/region.hpp): 64-bit, so
// they never wrap; the 32-bit tag a call writes for others to match is never
// 0 (zeroed memory) and repeats only between calls of unlike parity; the
// arrival target of a call is its parity's calls so far, mod 2^32.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/low_latency/region.hpp"

namespace turnout {
namespace {

namespace ll = kernels::low_latency;

constexpr uint64_t kTagPeriod = 0xffffffffull;

uint32_t tag_by_division(uint64_t n) {
  return static_cast<uint32_t>(1 + (n - 1) % kTagPeriod);
}

TEST(LowLatencyCallNumbers, TagIsTheNumberUntilItsWrap) {
  for (uint64_t n = 1; n < 100000; ++n) ASSERT_EQ(ll::call_tag(n), n);
  EXPECT_EQ(ll::call_tag(kTagPeriod), kTagPeriod);
  EXPECT_EQ(ll::call_tag(kTagPeriod + 1), 1u);
  EXPECT_EQ(ll::call_tag(kTagPeriod + 2), 2u);
}

TEST(LowLatencyCallNumbers, TagIsNeverZeroAndMatchesTheRemainder) {
  const uint64_t starts[] = {0xffff0000ull, 2 * kTagPeriod - 1000, 0x1'0000'0000ull * 3 - 500, 0xffffffffffff0000ull};
  for (uint64_t start : starts) {
    for (uint64_t n = start; n < start + 70000; ++n) {
      ASSERT_NE(ll::call_tag(n), 0u) << n;
      ASSERT_EQ(ll::call_tag(n), tag_by_division(n)) << n;
    }
  }
  EXPECT_EQ(ll::call_tag(0xffffffffffffffffull), tag_by_division(0xffffffffffffffffull));
}

TEST(LowLatencyCallNumbers, CallsWithOneTagHaveUnlikeParity) {
  for (uint64_t n : {1ull, 2ull, 0x7fffffffull, 0xfffffffeull, 0xffffffffull, 0x1'0000'0000ull}) {
    EXPECT_EQ(ll::call_tag(n), ll::call_tag(n + kTagPeriod));
    EXPECT_NE(n & 1, (n + kTagPeriod) & 1);
  }
}

// A parity's arrivals grow by kArrivalsPerCall a call of that parity, mod 2^32,
// across 2^32 as anywhere.
TEST(LowLatencyCallNumbers, ArrivalTargetsStepByOneCallOfTheirParity) {
  for (uint64_t n : {1ull, 2ull, 0xfffffff0ull, 0xfffffffeull, 0xffffffffull, 0x1'0000'0000ull, 0x1'0000'0001ull,
                     0x2'0000'0000ull - 3}) {
    EXPECT_EQ(static_cast<uint32_t>(ll::arrivals_after(n + 2) - ll::arrivals_after(n)), ll::kArrivalsPerCall) << n;
    EXPECT_EQ(ll::arrivals_after(n), static_cast<uint32_t>(((n + 1) / 2) * ll::kArrivalsPerCall)) << n;
  }
  EXPECT_EQ(ll::arrivals_after(0), 0u);
}

TEST(LowLatencyCallNumbers, CountersHoldSixtyFourBits) {
  EXPECT_EQ(sizeof(ll::CallCounter::seq), 8u);
  EXPECT_EQ(offsetof(ll::CallCounter, seq) % 8, 0u);
  EXPECT_EQ(offsetof(ll::LocalState, dispatch_send) % 8, 0u);
}

}  // namespace
}  // namespace turnout
