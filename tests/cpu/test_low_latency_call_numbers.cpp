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
    for (uint64_t i = 0; i < 70000; ++i) {
      const uint64_t n = start + i;  // wraps past 2^64 - 1 for the last start, as the tag must too
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

// clean_low_latency_buffer(first_call) sets every source's arrival counters
// as calls 1..first_call - 1 left them: the next call of each parity then
// waits for exactly one call's arrivals more.
TEST(LowLatencyCallNumbers, ArrivalsThroughACallLeaveOneCallToTheNext) {
  EXPECT_EQ(ll::arrivals_through(0, 0), 0u);
  EXPECT_EQ(ll::arrivals_through(0, 1), 0u);
  EXPECT_EQ(ll::arrivals_through(1, 1), ll::kArrivalsPerCall);
  EXPECT_EQ(ll::arrivals_through(1, 0), 0u);
  for (uint64_t first :
       {2ull, 3ull, 4ull, 0xfffffffdull, 0xfffffffeull, 0x1'0000'0000ull, 0x1'fffffffcull, 0x1'fffffffdull}) {
    const uint64_t last = first - 1;
    for (uint64_t n = first; n < first + 6; ++n) {
      // Before call n the counter of its parity holds the calls of that parity below n.
      uint32_t counter = ll::arrivals_through(last, static_cast<int>(n & 1));
      for (uint64_t m = first; m < n; ++m)
        if ((m & 1) == (n & 1)) counter += ll::kArrivalsPerCall;
      EXPECT_EQ(static_cast<uint32_t>(ll::arrivals_after(n) - counter), ll::kArrivalsPerCall) << first << " " << n;
    }
  }
}

// A restart's verdicts differ in their tag from the next call's, so its first
// judge of each peer writes its own; 2^31, where a zeroed word would match, too.
TEST(LowLatencyCallNumbers, VerdictAfterACallIsNotTheNextCalls) {
  for (uint64_t last : {1ull, 2ull, 0x7fffffffull, 0x80000000ull, 0xfffffffeull, 0xffffffffull, 0x1'0000'0000ull}) {
    const uint32_t verdict = ll::verdict_after(last);
    EXPECT_EQ(verdict & 1u, 1u);
    EXPECT_NE(verdict >> 1, ll::call_tag(last + 1) & 0x7fffffffu) << last;
  }
}

TEST(LowLatencyCallNumbers, CountersHoldSixtyFourBits) {
  EXPECT_EQ(sizeof(ll::CallCounter::seq), 8u);
  EXPECT_EQ(offsetof(ll::CallCounter, seq) % 8, 0u);
  EXPECT_EQ(offsetof(ll::LocalState, dispatch_send) % 8, 0u);
}

// A young buffer's word tags are no small numbers: a token index, count or
// entry number that a call of another shape left in memory cannot pass for
// one. And the mix is a bijection, never 0 but for 0, so two calls of one
// parity still have different word tags where their tags differ.
TEST(LowLatencyCallNumbers, WordTagsOfYoungBuffersAreNotSmallNumbers) {
  for (uint32_t seq = 1; seq < 0x10000u; ++seq) ASSERT_GE(ll::word_tag(seq), 0x10000u) << seq;
  EXPECT_EQ(ll::word_tag(0), 0u);
  // An odd multiplier has an inverse mod 2^32: the mix undoes.
  uint32_t inverse = 1;
  for (int i = 0; i < 5; ++i) inverse *= 2u - 0x9e3779b1u * inverse;
  for (uint64_t seq : {1ull, 2ull, 1000ull, 0x7fffffffull, 0xfffffffeull, 0xffffffffull}) {
    ASSERT_NE(ll::word_tag(static_cast<uint32_t>(seq)), 0u) << seq;
    ASSERT_EQ(ll::word_tag(static_cast<uint32_t>(seq)) * inverse, static_cast<uint32_t>(seq)) << seq;
  }
}

}  // namespace
}  // namespace turnout
