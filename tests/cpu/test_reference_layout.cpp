// get_dispatch_layout of the host reference: hand-checked cases and properties on random
// routings.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect_invalid_argument.hpp"
#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

// Random experts with some -1 slots and, by chance, duplicates within a row.
std::vector<int64_t> random_topk(std::mt19937& rng, int num_tokens, int num_topk, int num_experts) {
  std::uniform_int_distribution<int64_t> expert(0, num_experts - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  std::vector<int64_t> topk(static_cast<size_t>(num_tokens) * num_topk);
  for (int64_t& id : topk) id = percent(rng) < 15 ? -1 : expert(rng);
  return topk;
}

}  // namespace

TEST(ReferenceLayout, TwoRanksByHand) {
  // E = 4, L = 2. t0 -> experts 0, 3 (ranks 0, 1); t1 -> expert 1 twice (rank 0 once);
  // t2 -> -1 and expert 2 (rank 1).
  const std::vector<int64_t> topk = {0, 3, 1, 1, -1, 2};
  const ref::DispatchLayout layout = ref::get_dispatch_layout(topk, 3, 2, 2, 4, 1);
  EXPECT_EQ(layout.num_tokens_per_rank, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(layout.num_tokens_per_rdma_rank, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(layout.num_tokens_per_expert, (std::vector<int32_t>{1, 1, 1, 1}));
  EXPECT_EQ(layout.is_token_in_rank, (std::vector<uint8_t>{1, 1, 1, 0, 0, 1}));

  // One NVL domain of both ranks: a single RDMA rank that every routed token reaches.
  const ref::DispatchLayout one_host = ref::get_dispatch_layout(topk, 3, 2, 2, 4, 2);
  EXPECT_EQ(one_host.num_tokens_per_rdma_rank, (std::vector<int32_t>{3}));
}

TEST(ReferenceLayout, FourRanksTwoHostsByHand) {
  // R = 4, two NVL domains {0, 1} and {2, 3}, E = 8, L = 2.
  const std::vector<int64_t> topk = {
      0,  2,   // ranks 0, 1: both on host 0, so host 0 counts it once
      7,  -1,  // rank 3
      1,  6,   // ranks 0 and 3: both hosts
      -1, -1,  // nowhere
  };
  const ref::DispatchLayout layout = ref::get_dispatch_layout(topk, 4, 2, 4, 8, 2);
  EXPECT_EQ(layout.num_tokens_per_rank, (std::vector<int32_t>{2, 1, 0, 2}));
  EXPECT_EQ(layout.num_tokens_per_rdma_rank, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(layout.num_tokens_per_expert, (std::vector<int32_t>{1, 1, 1, 0, 0, 0, 1, 1}));
  EXPECT_EQ(layout.is_token_in_rank, (std::vector<uint8_t>{1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0}));
}

TEST(ReferenceLayout, NoTokensAndAllToOneExpert) {
  const ref::DispatchLayout empty = ref::get_dispatch_layout({}, 0, 4, 4, 8, 4);
  EXPECT_EQ(empty.num_tokens_per_rank, (std::vector<int32_t>(4, 0)));
  EXPECT_EQ(empty.num_tokens_per_rdma_rank, (std::vector<int32_t>(1, 0)));
  EXPECT_EQ(empty.num_tokens_per_expert, (std::vector<int32_t>(8, 0)));
  EXPECT_TRUE(empty.is_token_in_rank.empty());

  std::vector<int64_t> topk;
  for (int t = 0; t < 10; ++t) topk.insert(topk.end(), {5, -1, 5});
  const ref::DispatchLayout one = ref::get_dispatch_layout(topk, 10, 3, 4, 8, 2);
  EXPECT_EQ(one.num_tokens_per_rank, (std::vector<int32_t>{0, 0, 10, 0}));
  EXPECT_EQ(one.num_tokens_per_rdma_rank, (std::vector<int32_t>{0, 10}));
  EXPECT_EQ(one.num_tokens_per_expert, (std::vector<int32_t>{0, 0, 0, 0, 0, 10, 0, 0}));
}

TEST(ReferenceLayout, RandomRoutingProperties) {
  std::mt19937 rng(2024);
  const int shapes[][4] = {{8, 64, 8, 4}, {4, 32, 4, 2}, {2, 8, 3, 1}, {16, 256, 8, 8}};
  for (const auto& shape : shapes) {
    const int num_ranks = shape[0], num_experts = shape[1], num_topk = shape[2];
    const int num_nvl_ranks = shape[3];
    const int experts_per_rank = num_experts / num_ranks;
    const int num_tokens = 300;
    const std::vector<int64_t> topk = random_topk(rng, num_tokens, num_topk, num_experts);
    const ref::DispatchLayout layout =
        ref::get_dispatch_layout(topk, num_tokens, num_topk, num_ranks, num_experts, num_nvl_ranks);

    int64_t distinct_slots = 0;
    std::vector<int32_t> column_sums(num_ranks, 0);
    std::vector<int32_t> rdma_sums(num_ranks / num_nvl_ranks, 0);
    for (int t = 0; t < num_tokens; ++t) {
      std::set<int64_t> experts;
      std::set<int> ranks_hit, hosts_hit;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = topk[static_cast<size_t>(t) * num_topk + k];
        if (e < 0) continue;
        experts.insert(e);
        ranks_hit.insert(static_cast<int>(e / experts_per_rank));
        hosts_hit.insert(static_cast<int>(e / experts_per_rank) / num_nvl_ranks);
      }
      distinct_slots += static_cast<int64_t>(experts.size());
      for (int r = 0; r < num_ranks; ++r) {
        const uint8_t in = layout.is_token_in_rank[static_cast<size_t>(t) * num_ranks + r];
        ASSERT_EQ(in, ranks_hit.count(r) ? 1 : 0) << "token " << t << " rank " << r;
        column_sums[r] += in;
      }
      for (int h : hosts_hit) ++rdma_sums[h];
    }
    EXPECT_EQ(layout.num_tokens_per_rank, column_sums);
    EXPECT_EQ(layout.num_tokens_per_rdma_rank, rdma_sums);
    int64_t expert_total = 0;
    for (int32_t c : layout.num_tokens_per_expert) expert_total += c;
    EXPECT_EQ(expert_total, distinct_slots);
    // Each rank's token count is at most the sum of its experts' counts.
    for (int r = 0; r < num_ranks; ++r) {
      int64_t local = 0;
      for (int l = 0; l < experts_per_rank; ++l) local += layout.num_tokens_per_expert[r * experts_per_rank + l];
      EXPECT_LE(layout.num_tokens_per_rank[r], local);
    }
  }
}

TEST(ReferenceLayout, BadInputThrows) {
  const std::vector<int64_t> ok = {0, 1, 2, 3};
  expect_invalid_argument([] { ref::get_dispatch_layout(std::vector<int64_t>{0, 4}, 1, 2, 2, 4, 1); }, "topk_idx");
  expect_invalid_argument([] { ref::get_dispatch_layout(std::vector<int64_t>{-2, 0}, 1, 2, 2, 4, 1); }, "topk_idx");
  expect_invalid_argument([&] { ref::get_dispatch_layout(ok, 3, 2, 2, 4, 1); }, "topk_idx");
  expect_invalid_argument([&] { ref::get_dispatch_layout(ok, 2, 2, 4, 6, 1); }, "num_experts");
  expect_invalid_argument([&] { ref::get_dispatch_layout(ok, 2, 2, 4, 8, 3); }, "num_nvl_ranks");
  expect_invalid_argument([&] { ref::get_dispatch_layout(ok, 2, 2, 0, 8, 1); }, "num_ranks");
  expect_invalid_argument([&] { ref::get_dispatch_layout(ok, -1, 2, 2, 4, 1); }, "num_tokens");
  expect_invalid_argument([&] { ref::get_dispatch_layout(ok, 4, 0, 2, 4, 1); }, "num_topk");
  EXPECT_NO_THROW(ref::get_dispatch_layout(ok, 2, 2, 2, 4, 2));
}
