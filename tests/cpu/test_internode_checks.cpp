// Internode mode on the CPU: its regions' parts do not overlap, the size
// hints cover every call a config allows, and every bad argument or handle
// raises InvalidArgument naming it before anything is launched.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "kernels/internode/region.hpp"
#include "ops/internode/check.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace {

using namespace turnout;
namespace ki = kernels::internode;

template <class F>
void expect_error(F&& call, const std::string& op, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected an error of " << op << " naming '" << needle << "'";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(op + ":", 0), 0u) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
}

// Any non-null, 16-byte aligned address: the checks read no memory.
template <class T>
T* fake() {
  return reinterpret_cast<T*>(uintptr_t{1} << 20);
}

ki::Shape shape_of(int domains, int nvl_ranks, int channels, int experts, int slot) {
  ki::Shape s;
  s.num_domains = domains;
  s.num_nvl_ranks = nvl_ranks;
  s.num_channels = channels;
  s.num_local_experts = experts;
  s.net_slots = 128;
  s.nvl_slots = 256;
  s.slot_bytes = slot;
  return s;
}

template <size_t K>
void expect_disjoint(const std::pair<int64_t, int64_t> (&parts)[K]) {
  for (size_t i = 0; i < K; ++i)
    for (size_t j = i + 1; j < K; ++j)
      EXPECT_TRUE(parts[i].second <= parts[j].first || parts[j].second <= parts[i].first) << i << " and " << j;
}

TEST(InternodeRegion, NetworkPartsDoNotOverlap) {
  const int64_t N = 4, D = 8, C = 12, L = 8;
  const auto r = ki::make_net_region(shape_of(N, D, C, L, 14848));
  EXPECT_EQ(r.message_bytes, align_up((ki::kInfoInts + D + D * C + D * L + C) * 4, 16));
  const std::pair<int64_t, int64_t> parts[] = {{r.barrier, r.barrier + N * 4},
                                               {r.counts_arrived, r.counts_arrived + N * 4},
                                               {r.epoch, r.epoch + 4},
                                               {r.tails, r.tails + C * N * 4},
                                               {r.heads, r.heads + C * N * 4},
                                               {r.counts, r.counts + N * r.message_bytes},
                                               {r.outbox, r.outbox + N * r.message_bytes},
                                               {r.recv_rings, r.stage_rings},
                                               {r.stage_rings, r.total}};
  expect_disjoint(parts);
  EXPECT_EQ(r.recv_slot(C - 1, N - 1, 127) + 14848, r.stage_rings);
  EXPECT_EQ(r.stage_slot(C - 1, N - 1, 127) + 14848, r.total);
  EXPECT_LE(r.outbox + N * r.message_bytes, ki::kNetMetaBytes);
}

// Shrink mode: a counter word per rank, a message, tail and head per (domain,
// part); the rings keep their size and place, so the size hints still cover them.
TEST(InternodeRegion, ShrinkPartsDoNotOverlap) {
  const int64_t N = 4, D = 8, C = 12, L = 8, R = N * D;
  ki::Shape shape = shape_of(N, D, C, L, 14848);
  const auto plain = ki::make_net_region(shape);
  shape.max_parts = D;
  const auto r = ki::make_net_region(shape);
  EXPECT_EQ(r.counter_words(), R);
  EXPECT_EQ(plain.counter_words(), N);
  const std::pair<int64_t, int64_t> parts[] = {{r.barrier, r.barrier + R * 4},
                                               {r.counts_arrived, r.counts_arrived + R * 4},
                                               {r.epoch, r.epoch + 4},
                                               {r.tails, r.tails + C * N * D * 4},
                                               {r.heads, r.heads + C * N * D * 4},
                                               {r.counts, r.counts + N * D * r.message_bytes},
                                               {r.outbox, r.outbox + N * r.message_bytes},
                                               {r.recv_rings, r.stage_rings},
                                               {r.stage_rings, r.total}};
  expect_disjoint(parts);
  EXPECT_EQ(r.tail(C - 1, N - 1, D - 1) + 4, r.tails + C * N * D * 4);
  EXPECT_EQ(r.head(C - 1, N - 1, D - 1) + 4, r.heads + C * N * D * 4);
  EXPECT_EQ(r.message(N - 1, D - 1) + r.message_bytes, r.counts + N * D * r.message_bytes);
  EXPECT_EQ(r.total - r.recv_rings, plain.total - plain.recv_rings);
  // Without shrink mode the part accessors at part 0 are the plain ones.
  EXPECT_EQ(plain.tail(3, 2, 0), plain.tail(3, 2));
  EXPECT_EQ(plain.head(3, 2, 0), plain.head(3, 2));
  EXPECT_EQ(plain.message(2, 0), plain.message(2));
  // A ring of 42 slots in 8 parts: 5 each, back to back.
  EXPECT_EQ(ki::part_slots(42, 8), 5);
  EXPECT_EQ(ki::part_first_slot(42, 8, 7), 35);
  EXPECT_EQ(ki::make_shape(N, D, 24, 128, 256, L, 14848).max_parts, 1);
  EXPECT_EQ(ki::make_shape(N, D, 24, 128, 256, L, 14848, true).max_parts, D);
}

TEST(InternodeRegion, NvlPartsDoNotOverlap) {
  const int64_t N = 4, D = 8, C = 12, L = 8, R = N * D;
  const auto r = ki::make_nvl_region(shape_of(N, D, C, L, 14848));
  EXPECT_EQ(r.source_ints, ki::kInfoInts + 1 + C + L);
  const std::pair<int64_t, int64_t> parts[] = {{r.barrier, r.barrier + D * 4},
                                               {r.epoch, r.epoch + 4},
                                               {r.status, r.status + 4},
                                               {r.input_error, r.input_error + 24},
                                               {r.relayed, r.relayed + D * 4},
                                               {r.tails, r.tails + C * D * N * 4},
                                               {r.heads, r.heads + C * D * N * 4},
                                               {r.sources, r.sources + R * r.source_ints * 4},
                                               {r.rings, r.total}};
  expect_disjoint(parts);
  EXPECT_EQ(r.sub_slots(), 64);
  EXPECT_EQ(r.slot(C - 1, D - 1, N - 1, 63) + 14848, r.total);
}

// The hints cover a BF16 and an FP8 dispatch at the largest top-k and a
// combine, for every domain shape of the group.
TEST(InternodeRegion, SizeHintsCoverEveryCall) {
  for (int hidden : {1024, 4096, 7168}) {
    for (int nvl_ranks : {1, 2, 4, 8}) {
      for (int domains : {2, 3, 4, 8, 16}) {
        const int ranks = nvl_ranks * domains;
        if (ranks < kMinRanks || ranks > kMaxRanks) continue;
        for (int sms : {2, 20, 24}) {
          const Config config(sms, 8, 256, 16, 128);
          const size_t net_hint = config.get_rdma_buffer_size_hint(size_t(hidden) * 2, ranks, nvl_ranks);
          const size_t nvl_hint = config.get_nvl_buffer_size_hint(size_t(hidden) * 2, ranks);
          for (int slot : {ki::make_token_slot(hidden * 2, 0, kMaxTopk).bytes,
                           ki::make_token_slot(hidden, hidden / 128, kMaxTopk).bytes,
                           kernels::make_combine_slot(hidden, kMaxTopk).bytes}) {
            const ki::Shape s = ki::make_shape(domains, nvl_ranks, sms, 128, 256, 0, slot);
            EXPECT_LE(static_cast<size_t>(ki::make_net_region(s).total), net_hint)
                << hidden << " " << nvl_ranks << "x" << domains << " " << sms;
            EXPECT_LE(static_cast<size_t>(ki::make_nvl_region(s).total), nvl_hint)
                << hidden << " " << nvl_ranks << "x" << domains << " " << sms;
          }
        }
      }
    }
  }
}

TEST(InternodeRegion, SizeHintTakesTheDeclaredDomainSize) {
  const Config config(20, 8, 256, 16, 128);
  ::setenv("TURNOUT_NVL_DOMAIN_SIZE", "2", 1);
  const size_t declared = config.get_rdma_buffer_size_hint(14336, 8);
  ::unsetenv("TURNOUT_NVL_DOMAIN_SIZE");
  EXPECT_EQ(declared, config.get_rdma_buffer_size_hint(14336, 8, 2));
  EXPECT_GT(declared, 0u);
  // Undeclared: domains of 8, so a group of 8 needs no network region.
  EXPECT_EQ(config.get_rdma_buffer_size_hint(14336, 8), 0u);
  EXPECT_EQ(config.get_rdma_buffer_size_hint(14336, 16), config.get_rdma_buffer_size_hint(14336, 16, 8));
  EXPECT_EQ(config.get_rdma_buffer_size_hint(14336, 4, 4), 0u);
  EXPECT_THROW(config.get_rdma_buffer_size_hint(14336, 6, 4), InvalidArgument);
  EXPECT_THROW(config.get_rdma_buffer_size_hint(14336, 8, 0), InvalidArgument);
  EXPECT_THROW(config.get_rdma_buffer_size_hint(14336, 8, 9), InvalidArgument);
  EXPECT_THROW(config.get_rdma_buffer_size_hint(14336, 66, 2), InvalidArgument);  // 33 domains
  // A dispatch channel's warps share a block: domains plus ranks per domain at most 32.
  EXPECT_THROW(config.get_rdma_buffer_size_hint(14336, 32, 1), InvalidArgument);
  EXPECT_THROW(config.get_rdma_buffer_size_hint(14336, 116, 4), InvalidArgument);  // 29 domains of 4
  EXPECT_GT(config.get_rdma_buffer_size_hint(14336, 31, 1), 0u);
  EXPECT_GT(config.get_rdma_buffer_size_hint(14336, 112, 4), 0u);
}

internode::BufferShape buffer_of(int ranks, int nvl_ranks) {
  internode::BufferShape s;
  s.num_ranks = ranks;
  s.num_nvl_ranks = nvl_ranks;
  s.num_sms = 20;
  const Config config(20, 8, 256, 16, 128);
  s.num_nvl_bytes = config.get_nvl_buffer_size_hint(7168 * 2, ranks);
  s.num_rdma_bytes = config.get_rdma_buffer_size_hint(7168 * 2, ranks, nvl_ranks);
  return s;
}

// The channels of a call on buffer_of(16, 8): 10 block pairs of 3 channels
// (a channel's 2 senders and 8 receivers are 10 of a block's 32 warps).
constexpr int kChannels16x8 = 30;

InternodeHandle handle_of(int num_tokens, int num_recv, int num_forward) {
  InternodeHandle h;
  h.is_token_in_rank = fake<const bool>();
  h.rdma_channel_prefix_matrix = h.gbl_channel_prefix_matrix = h.recv_rdma_channel_prefix_matrix =
      h.recv_rdma_rank_prefix_sum = h.recv_gbl_channel_prefix_matrix = h.recv_gbl_rank_prefix_sum = h.recv_src_meta =
          h.send_rdma_head = h.send_nvl_head = fake<int32_t>();
  h.num_tokens = num_tokens;
  h.num_channels = kChannels16x8;
  h.num_recv = num_recv;
  h.num_forward = num_forward;
  return h;
}

InternodeDispatchCountsArgs good_counts() {
  InternodeDispatchCountsArgs a;
  a.num_tokens = 128;
  a.num_tokens_per_expert = fake<const int32_t>();
  a.num_experts = 64;
  a.topk_idx = fake<const int64_t>();
  a.num_topk = 8;
  a.config = Config(20, 8, 256, 16, 128);
  a.handle = handle_of(128, 0, 0);
  return a;
}

InternodeDispatchArgs good_dispatch() {
  InternodeDispatchArgs a;
  a.x = fake<const void>();
  a.num_tokens = 128;
  a.row_bytes = 7168 * 2;
  a.topk_idx = fake<const int64_t>();
  a.topk_weights = fake<const float>();
  a.num_topk = 8;
  a.num_experts = 64;
  a.config = Config(20, 8, 256, 16, 128);
  a.handle = handle_of(128, 300, 200);
  a.recv_x = fake<void>();
  a.recv_topk_idx = fake<int64_t>();
  a.recv_topk_weights = fake<float>();
  return a;
}

InternodeCombineArgs good_combine() {
  InternodeCombineArgs a;
  a.x = fake<const void>();
  a.hidden = 7168;
  a.config = Config(20, 8, 256, 16, 128);
  a.handle = handle_of(128, 300, 200);
  a.combined_x = fake<void>();
  return a;
}

TEST(InternodeCheck, GoodArgumentsPass) {
  const auto shape = buffer_of(16, 8);
  EXPECT_NO_THROW(internode::check_dispatch_counts(good_counts(), shape));
  const auto r = internode::check_dispatch(good_dispatch(), shape);
  EXPECT_EQ(r.net.shape.num_domains, 2);
  EXPECT_EQ(r.nvl.shape.num_channels, kChannels16x8);
  // Each channel has a third of the rings' slots.
  EXPECT_EQ(r.net.shape.net_slots, 128 / 3);
  EXPECT_EQ(r.nvl.shape.nvl_slots, 256 / 3);
  EXPECT_NO_THROW(internode::check_combine(good_combine(), shape));
  // Emulated domains: 4 ranks as 2 of 2 and 8 as 4 of 2 (4 warps and 6 a
  // channel): block pairs of 4 channels, the most a block runs.
  auto a = good_dispatch();
  a.handle.num_channels = 40;
  EXPECT_NO_THROW(internode::check_dispatch(a, buffer_of(4, 2)));
  EXPECT_NO_THROW(internode::check_dispatch(a, buffer_of(8, 2)));
  EXPECT_EQ(internode_channels_per_block(2, 2), 4);
  EXPECT_EQ(internode_channels_per_block(2, 8), 3);
  EXPECT_EQ(internode_channels_per_block(8, 8), 2);
  EXPECT_EQ(internode_channels_per_block(24, 8), 1);
}

TEST(InternodeCheck, ConfigIsChecked) {
  const auto shape = buffer_of(16, 8);
  auto a = good_dispatch();
  a.config.num_sms = 7;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "config.num_sms");
  a = good_dispatch();
  a.config.num_max_rdma_chunked_send_tokens = 200;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "num_max_rdma_chunked_send_tokens");
  a = good_dispatch();
  a.config.num_max_nvl_chunked_send_tokens = 0;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "num_max_nvl_chunked_send_tokens");
  // Combine splits an NVL ring per source domain: 4 domains need 4 slots.
  auto c = good_combine();
  c.config = Config(20, 2, 3, 2, 4);
  expect_error([&] { internode::check_combine(c, buffer_of(16, 4)); }, "combine", "num_max_nvl_chunked_recv_tokens");
  // A block pair runs 3 channels at 2 domains of 8, each with a third of the
  // rings: 6 NVL slots at least (2 per channel), and 3 network slots.
  c = good_combine();
  c.config = Config(20, 2, 5, 2, 16);
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "at least 6");
  c.config = Config(20, 2, 6, 2, 2);
  expect_error([&] { internode::check_combine(c, shape); }, "combine",
               "num_max_rdma_chunked_recv_tokens must be at least 3");
  c.config = Config(20, 2, 6, 3, 3);
  EXPECT_NO_THROW(internode::check_combine(c, shape));
}

TEST(InternodeCheck, HandleIsChecked) {
  const auto shape = buffer_of(16, 8);
  auto c = good_combine();
  c.handle.num_channels = 10;  // a channel per block pair: not what this call runs
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "10 channels");
  c = good_combine();
  c.handle.send_nvl_head = nullptr;
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "handle[9] (send_nvl_head)");
  c = good_combine();
  c.handle.recv_gbl_rank_prefix_sum = nullptr;
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "entries [1] to [6]");
  c = good_combine();
  c.handle.is_token_in_rank = nullptr;
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "handle[0] (is_token_in_rank)");
  auto d = good_dispatch();
  d.handle.recv_src_meta = nullptr;
  expect_error([&] { internode::check_dispatch(d, shape); }, "dispatch", "handle[7] (recv_src_meta)");
  d = good_dispatch();
  d.handle.num_tokens = 5;
  expect_error([&] { internode::check_dispatch(d, shape); }, "dispatch", "handle's token count");
  // The counts step writes [7]-[9] later: they may be absent then.
  auto n = good_counts();
  n.handle.recv_src_meta = n.handle.send_rdma_head = n.handle.send_nvl_head = nullptr;
  EXPECT_NO_THROW(internode::check_dispatch_counts(n, shape));
}

TEST(InternodeCheck, ShrinkModeHandlesAndConfigs) {
  auto shape = buffer_of(16, 8);
  auto c = good_combine();
  // Without shrink mode a handle carries no live set; with it, it must.
  c.handle.live = fake<uint32_t>();
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "shrink mode only");
  shape.shrink = true;
  EXPECT_NO_THROW(internode::check_combine(c, shape));
  c.handle.live = nullptr;
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "entry [10]");
  // A domain's only survivor forwards for 8 columns: a part of a channel's
  // network ring each (3 channels a block pair at 2 domains of 8).
  c = good_combine();
  c.handle.live = fake<uint32_t>();
  c.config = Config(20, 8, 256, 16, 23);
  expect_error([&] { internode::check_combine(c, shape); }, "combine", "at least 24 in shrink mode");
  c.config = Config(20, 8, 256, 16, 24);
  EXPECT_NO_THROW(internode::check_combine(c, shape));
  const auto r = internode::check_combine(c, shape);
  EXPECT_EQ(r.net.shape.max_parts, 8);
}

TEST(InternodeCheck, CountsArgumentsAreChecked) {
  const auto shape = buffer_of(16, 8);
  auto a = good_counts();
  a.num_experts = 60;
  expect_error([&] { internode::check_dispatch_counts(a, shape); }, "dispatch", "num_experts");
  a = good_counts();
  a.num_topk = kMaxTopk + 1;
  expect_error([&] { internode::check_dispatch_counts(a, shape); }, "dispatch", "num_topk");
  a = good_counts();
  a.expert_alignment = 0;
  expect_error([&] { internode::check_dispatch_counts(a, shape); }, "dispatch", "expert_alignment");
  a = good_counts();
  a.num_worst_tokens = -1;
  expect_error([&] { internode::check_dispatch_counts(a, shape); }, "dispatch", "num_worst_tokens");
  a = good_counts();
  a.cached = true;
  expect_error([&] { internode::check_dispatch_counts(a, shape); }, "dispatch", "cached dispatch");
  a = good_counts();
  a.num_experts = 16 * 4096;
  expect_error([&] { internode::check_dispatch_counts(a, shape); }, "dispatch", "experts");
}

TEST(InternodeCheck, DispatchArgumentsAreChecked) {
  const auto shape = buffer_of(16, 8);
  auto a = good_dispatch();
  a.row_bytes = 24;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "multiple of 16 bytes");
  a = good_dispatch();
  a.num_scales = 56;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "x_scales");
  a = good_dispatch();
  a.recv_topk_weights = nullptr;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "recv_topk_weights");
  a = good_dispatch();
  a.num_worst_tokens = 1000;
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "num_worst_tokens");
  a.handle.num_recv = 1000;
  a.handle.num_forward = 8 * 1000;
  EXPECT_NO_THROW(internode::check_dispatch(a, shape));
  a = good_dispatch();
  a.recv_x = reinterpret_cast<void*>(uintptr_t{1} << 20 | 8);
  expect_error([&] { internode::check_dispatch(a, shape); }, "dispatch", "recv_x");
}

TEST(InternodeCheck, SmallBuffersAreRefusedNamingTheHint) {
  auto shape = buffer_of(16, 8);
  shape.num_rdma_bytes /= 2;
  expect_error([&] { internode::check_dispatch(good_dispatch(), shape); }, "dispatch", "get_rdma_buffer_size_hint");
  shape = buffer_of(16, 8);
  shape.num_nvl_bytes /= 2;
  expect_error([&] { internode::check_combine(good_combine(), shape); }, "combine", "get_nvl_buffer_size_hint");
}

TEST(InternodeCheck, CombineArgumentsAreChecked) {
  const auto shape = buffer_of(16, 8);
  auto a = good_combine();
  a.hidden = 7;
  expect_error([&] { internode::check_combine(a, shape); }, "combine", "hidden");
  a = good_combine();
  a.num_topk = 8;
  expect_error([&] { internode::check_combine(a, shape); }, "combine", "topk_weights");
  a = good_combine();
  a.bias1 = reinterpret_cast<const void*>(uintptr_t{1} << 20 | 2);
  expect_error([&] { internode::check_combine(a, shape); }, "combine", "biases");
}

}  // namespace
