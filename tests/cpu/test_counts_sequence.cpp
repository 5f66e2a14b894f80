// The normal-mode counts mailbox's sequence (ops/intranode/intranode.hpp):
// never 0, the zeroed mailbox's value, across its wrap; unsigned, so no
// overflow; as the int32 the kernel stores, every value but 0 once a cycle.
#include <gtest/gtest.h>

#include <cstdint>

#include "ops/intranode/intranode.hpp"

namespace turnout {
namespace {

TEST(CountsSequence, CountsFromOneAndSkipsZeroAtTheWrap) {
  EXPECT_EQ(intranode::next_counts_sequence(0), 1u);
  EXPECT_EQ(intranode::next_counts_sequence(1), 2u);
  EXPECT_EQ(intranode::next_counts_sequence(0x7fffffffu), 0x80000000u);
  EXPECT_EQ(intranode::next_counts_sequence(UINT32_MAX - 1), UINT32_MAX);
  EXPECT_EQ(intranode::next_counts_sequence(UINT32_MAX), 1u);
}

TEST(CountsSequence, NoValueAroundTheWrapIsZeroAsTheKernelStoresIt) {
  uint32_t s = UINT32_MAX - 1000;
  for (int i = 0; i < 3000; ++i) {
    const uint32_t next = intranode::next_counts_sequence(s);
    ASSERT_NE(static_cast<int32_t>(next), 0) << s;
    ASSERT_NE(next, s);
    s = next;
  }
  EXPECT_EQ(s, 2000u);
}

}  // namespace
}  // namespace turnout
