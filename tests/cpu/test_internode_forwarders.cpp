// The forwarder plan of shrink mode across NVL domains
// (src/kernels/internode/forwarders.hpp): for every position of a masked rank,
// several masked ranks in one domain, a domain's only live rank and a whole
// masked domain, at the shapes the GPU jobs run (4 ranks as 2 domains of 2, 8
// as 2 of 4 and 4 of 2, 16 as 2 of 8), then random live sets checked against
// the definition.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/internode/forwarders.hpp"

namespace ki = turnout::kernels::internode;

namespace {

// The live set of num_ranks ranks without `masked`.
std::vector<uint32_t> live_without(int num_ranks, const std::set<int>& masked) {
  std::vector<uint32_t> words(ki::rank_set_words(num_ranks), 0);
  for (int r = 0; r < num_ranks; ++r)
    if (!masked.count(r)) words[r / 32] |= 1u << (r % 32);
  return words;
}

// The definition, written out: the first live column of `domain` at or after
// `column` going up and wrapping, -1 if none.
int first_live_from(const std::set<int>& masked, int nvl, int domain, int column) {
  for (int k = 0; k < nvl; ++k) {
    const int m = (column + k) % nvl;
    if (!masked.count(domain * nvl + m)) return m;
  }
  return -1;
}

// Every property of one plan, against the definition.
void check_plan(int num_domains, int nvl, const std::set<int>& masked) {
  const std::vector<uint32_t> live = live_without(num_domains * nvl, masked);
  const ki::Forwarders plan{live.data(), num_domains, nvl};
  for (int e = 0; e < num_domains; ++e) {
    // Column -> the forwarder that claims to serve it.
    std::vector<int> claimed(nvl, -1);
    for (int local = 0; local < nvl; ++local) {
      const int rank = e * nvl + local;
      SCOPED_TRACE("rank " + std::to_string(rank));
      EXPECT_EQ(plan.is_live(e, local), !masked.count(rank));
      const uint32_t served = plan.served(e, local);
      int parts = 0;
      for (int m = 0; m < nvl; ++m) {
        if (!(served >> m & 1)) continue;
        ASSERT_EQ(claimed[m], -1) << "column " << m << " served twice";
        claimed[m] = local;
        EXPECT_EQ(plan.served_column(e, local, parts), m);
        ++parts;
      }
      EXPECT_EQ(plan.num_parts(e, local), parts);
      EXPECT_EQ(plan.served_column(e, local, parts), -1);
      if (masked.count(rank)) EXPECT_EQ(served, 0u);
      if (!masked.count(rank)) EXPECT_TRUE(served >> local & 1) << "a live rank serves its own column";
    }
    for (int n = 0; n < nvl; ++n) {
      const int f = plan.forwarder(e, n);
      EXPECT_EQ(f, first_live_from(masked, nvl, e, n)) << "domain " << e << " column " << n;
      EXPECT_EQ(claimed[n], f) << "domain " << e << " column " << n;
      if (f == ki::kNoForwarder) {
        EXPECT_EQ(plan.part(e, n), -1);
        continue;
      }
      const int p = plan.part(e, n);
      ASSERT_GE(p, 0);
      EXPECT_EQ(plan.served_column(e, f, p), n) << "domain " << e << " column " << n;
    }
  }
}

const std::pair<int, int> kShapes[] = {{2, 2}, {2, 4}, {4, 2}, {2, 8}};  // (domains, D)

}  // namespace

TEST(InternodeForwarders, RankSetLayout) {
  EXPECT_EQ(ki::rank_set_words(1), 1);
  EXPECT_EQ(ki::rank_set_words(32), 1);
  EXPECT_EQ(ki::rank_set_words(33), 2);
  EXPECT_EQ(ki::rank_set_words(1024), 32);
  const std::vector<uint32_t> set = {0x80000001u, 0x4u};
  EXPECT_TRUE(ki::rank_in_set(set.data(), 0));
  EXPECT_FALSE(ki::rank_in_set(set.data(), 1));
  EXPECT_TRUE(ki::rank_in_set(set.data(), 31));
  EXPECT_FALSE(ki::rank_in_set(set.data(), 32));
  EXPECT_TRUE(ki::rank_in_set(set.data(), 34));
}

TEST(InternodeForwarders, EveryRankLiveForwardsItsOwnColumn) {
  for (const auto& [domains, nvl] : kShapes) {
    const std::vector<uint32_t> live = live_without(domains * nvl, {});
    for (const ki::Forwarders& plan :
         {ki::Forwarders{live.data(), domains, nvl}, ki::Forwarders{nullptr, domains, nvl}})
      for (int e = 0; e < domains; ++e)
        for (int n = 0; n < nvl; ++n) {
          EXPECT_EQ(plan.forwarder(e, n), n);
          EXPECT_EQ(plan.served(e, n), 1u << n);
          EXPECT_EQ(plan.num_parts(e, n), 1);
          EXPECT_EQ(plan.part(e, n), 0);
        }
  }
}

TEST(InternodeForwarders, OneMaskedRankInEveryPosition) {
  // The next column up forwards for the masked one; the last column's wraps to
  // column 0, where it is the higher of the two parts.
  for (const auto& [domains, nvl] : kShapes)
    for (int masked = 0; masked < domains * nvl; ++masked) {
      SCOPED_TRACE(std::to_string(domains) + " domains of " + std::to_string(nvl) + ", rank " + std::to_string(masked) +
                   " masked");
      check_plan(domains, nvl, {masked});
      const std::vector<uint32_t> live = live_without(domains * nvl, {masked});
      const ki::Forwarders plan{live.data(), domains, nvl};
      const int e = masked / nvl, n = masked % nvl, next = (n + 1) % nvl;
      EXPECT_EQ(plan.forwarder(e, n), next);
      EXPECT_EQ(plan.num_parts(e, n), 0);
      EXPECT_EQ(plan.num_parts(e, next), 2);
      EXPECT_EQ(plan.served(e, next), (1u << n) | (1u << next));
      EXPECT_EQ(plan.part(e, n), n < next ? 0 : 1);
      EXPECT_EQ(plan.part(e, next), n < next ? 1 : 0);
      // Every other column of the domain, and every column of the other domains, is its own.
      for (int f = 0; f < domains; ++f)
        for (int m = 0; m < nvl; ++m) {
          if (f == e && (m == n || m == next)) continue;
          EXPECT_EQ(plan.forwarder(f, m), m);
          EXPECT_EQ(plan.num_parts(f, m), 1);
          EXPECT_EQ(plan.part(f, m), 0);
        }
    }
}

TEST(InternodeForwarders, TwoMaskedRanksInOneDomain) {
  // D = 4, domain 1 (ranks 4-7) of 2.
  {
    // Columns 1 and 2 masked: column 3 forwards both, parts {1, 2, 3}.
    const std::vector<uint32_t> live = live_without(8, {5, 6});
    const ki::Forwarders plan{live.data(), 2, 4};
    EXPECT_EQ(plan.forwarder(1, 1), 3);
    EXPECT_EQ(plan.forwarder(1, 2), 3);
    EXPECT_EQ(plan.served(1, 3), 0b1110u);
    EXPECT_EQ(plan.num_parts(1, 3), 3);
    EXPECT_EQ(plan.part(1, 1), 0);
    EXPECT_EQ(plan.part(1, 2), 1);
    EXPECT_EQ(plan.part(1, 3), 2);
    EXPECT_EQ(plan.num_parts(1, 0), 1);
    check_plan(2, 4, {5, 6});
  }
  {
    // Columns 3 and 0 masked: the run wraps; column 1 forwards 3, 0 and itself.
    const std::vector<uint32_t> live = live_without(8, {7, 4});
    const ki::Forwarders plan{live.data(), 2, 4};
    EXPECT_EQ(plan.forwarder(1, 3), 1);
    EXPECT_EQ(plan.forwarder(1, 0), 1);
    EXPECT_EQ(plan.served(1, 1), 0b1011u);
    EXPECT_EQ(plan.part(1, 0), 0);
    EXPECT_EQ(plan.part(1, 1), 1);
    EXPECT_EQ(plan.part(1, 3), 2);
    EXPECT_EQ(plan.served_column(1, 1, 2), 3);
    EXPECT_EQ(plan.num_parts(1, 2), 1);
    check_plan(2, 4, {7, 4});
  }
  {
    // Columns 0 and 2 masked: two substitutes of two parts each.
    const std::vector<uint32_t> live = live_without(8, {4, 6});
    const ki::Forwarders plan{live.data(), 2, 4};
    EXPECT_EQ(plan.forwarder(1, 0), 1);
    EXPECT_EQ(plan.forwarder(1, 2), 3);
    EXPECT_EQ(plan.served(1, 1), 0b0011u);
    EXPECT_EQ(plan.served(1, 3), 0b1100u);
    check_plan(2, 4, {4, 6});
  }
  // Every pair at every shape.
  for (const auto& [domains, nvl] : kShapes)
    for (int a = 0; a < domains * nvl; ++a)
      for (int b = a + 1; b < domains * nvl; ++b) {
        SCOPED_TRACE(std::to_string(domains) + "x" + std::to_string(nvl) + " masked " + std::to_string(a) + ", " +
                     std::to_string(b));
        check_plan(domains, nvl, {a, b});
      }
}

TEST(InternodeForwarders, ADomainsOnlyLiveRankForwardsEveryColumn) {
  for (const auto& [domains, nvl] : kShapes)
    for (int only = 0; only < nvl; ++only) {
      std::set<int> masked;
      for (int m = 0; m < nvl; ++m)
        if (m != only) masked.insert(nvl + m);  // domain 1
      const std::vector<uint32_t> live = live_without(domains * nvl, masked);
      const ki::Forwarders plan{live.data(), domains, nvl};
      EXPECT_EQ(plan.num_parts(1, only), nvl);
      EXPECT_EQ(plan.served(1, only), nvl == 32 ? ~0u : (1u << nvl) - 1);
      for (int n = 0; n < nvl; ++n) {
        EXPECT_EQ(plan.forwarder(1, n), only);
        EXPECT_EQ(plan.part(1, n), n) << "parts in column order";
      }
      check_plan(domains, nvl, masked);
    }
}

TEST(InternodeForwarders, AWholeMaskedDomainHasNoForwarder) {
  for (const auto& [domains, nvl] : kShapes) {
    std::set<int> masked;
    for (int m = 0; m < nvl; ++m) masked.insert(m);  // domain 0
    const std::vector<uint32_t> live = live_without(domains * nvl, masked);
    const ki::Forwarders plan{live.data(), domains, nvl};
    for (int n = 0; n < nvl; ++n) {
      EXPECT_EQ(plan.forwarder(0, n), ki::kNoForwarder);
      EXPECT_EQ(plan.part(0, n), -1);
      EXPECT_EQ(plan.num_parts(0, n), 0);
      EXPECT_EQ(plan.served(0, n), 0u);
      EXPECT_EQ(plan.forwarder(1, n), n);
    }
    check_plan(domains, nvl, masked);
  }
  // Domains of one rank: a masked rank is a masked domain.
  const std::vector<uint32_t> live = live_without(4, {2});
  const ki::Forwarders plan{live.data(), 4, 1};
  EXPECT_EQ(plan.forwarder(2, 0), ki::kNoForwarder);
  EXPECT_EQ(plan.forwarder(3, 0), 0);
  check_plan(4, 1, {2});
}

TEST(InternodeForwarders, RandomLiveSetsUpTo1024Ranks) {
  // Ranks past the first word of the set count: 1024 ranks as 128 domains of 8.
  std::mt19937 rng(11);
  const std::pair<int, int> shapes[] = {{2, 2}, {2, 4}, {4, 2}, {2, 8}, {3, 8}, {8, 1}, {5, 3}, {128, 8}, {32, 32}};
  for (const auto& [domains, nvl] : shapes)
    for (int trial = 0; trial < 20; ++trial) {
      std::set<int> masked;
      const int percent = std::uniform_int_distribution<int>(0, 90)(rng);
      for (int r = 0; r < domains * nvl; ++r)
        if (std::uniform_int_distribution<int>(0, 99)(rng) < percent) masked.insert(r);
      SCOPED_TRACE(std::to_string(domains) + "x" + std::to_string(nvl) + " trial " + std::to_string(trial));
      check_plan(domains, nvl, masked);
      if (::testing::Test::HasFatalFailure()) return;
    }
  // The last rank of 1024 masked: its column wraps to the domain's first.
  const std::vector<uint32_t> live = live_without(1024, {1023});
  const ki::Forwarders plan{live.data(), 128, 8};
  EXPECT_EQ(plan.forwarder(127, 7), 0);
  EXPECT_EQ(plan.part(127, 7), 1);
  EXPECT_EQ(plan.forwarder(126, 7), 7);
}
