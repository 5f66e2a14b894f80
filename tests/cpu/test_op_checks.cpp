// The ops' argument checks, as free functions on the CPU: every bad argument
// raises turnout::InvalidArgument whose message starts with the op and names
// the argument; good arguments pass and size the call's buffer region.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "ops/intranode/check.hpp"
#include "ops/layout/layout.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace {

using namespace turnout;

template <class Error = InvalidArgument, class F>
void expect_error(F&& call, const std::string& op, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected an error of " << op << " naming '" << needle << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(op + ":", 0), 0u) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
}

// Any non-null address: the checks read no memory. 16-byte aligned unless
// offset.
template <class T>
T* fake(uintptr_t offset = 0) {
  return reinterpret_cast<T*>(uintptr_t{1} << 20 | offset);
}

Topology group_of(int num_ranks) {
  Topology t;
  t.rank = 1;
  t.num_ranks = num_ranks;
  t.num_nvl_ranks = num_ranks;
  return t;
}

LayoutArgs good_layout() {
  LayoutArgs a;
  a.topk_idx = fake<const int64_t>();
  a.num_tokens = 128;
  a.num_topk = 8;
  a.num_experts = 64;
  a.num_tokens_per_rank = fake<int32_t>();
  a.num_tokens_per_expert = fake<int32_t>();
  a.is_token_in_rank = fake<bool>();
  return a;
}

TEST(LayoutCheck, GoodArgumentsPass) {
  EXPECT_NO_THROW(layout::check(good_layout(), group_of(4)));
  LayoutArgs empty = good_layout();
  empty.num_tokens = 0;
  empty.topk_idx = nullptr;
  empty.is_token_in_rank = nullptr;
  EXPECT_NO_THROW(layout::check(empty, group_of(4)));
}

TEST(LayoutCheck, BadArgumentsNameThemselves) {
  const std::string op = "get_dispatch_layout";
  auto with = [](auto change) {
    LayoutArgs a = good_layout();
    change(a);
    return [a] { layout::check(a, group_of(4)); };
  };
  expect_error(with([](LayoutArgs& a) { a.num_tokens = -1; }), op, "num_tokens");
  expect_error(with([](LayoutArgs& a) { a.num_topk = 0; }), op, "num_topk");
  expect_error(with([](LayoutArgs& a) { a.num_topk = kMaxTopk + 1; }), op, "num_topk");
  expect_error(with([](LayoutArgs& a) { a.num_experts = 66; }), op, "num_experts");
  expect_error(with([](LayoutArgs& a) { a.num_experts = 0; }), op, "num_experts");
  expect_error(with([](LayoutArgs& a) { a.topk_idx = nullptr; }), op, "topk_idx");
  expect_error(with([](LayoutArgs& a) { a.num_tokens_per_expert = nullptr; }), op, "num_tokens_per_expert");
  expect_error<NotSupported>(with([](LayoutArgs& a) { a.num_experts = 4 * layout::kMaxCounters; }), op, "counters");
}

TEST(LayoutCheck, WorkspaceHoldsEveryCounterAndTheBlockCount) {
  EXPECT_EQ(layout::workspace_bytes(10), 11 * sizeof(int32_t));
}

intranode::BufferShape shape_of(int num_ranks, size_t num_nvl_bytes = size_t{1} << 30) {
  return {num_ranks, 20, num_nvl_bytes};
}

DispatchCountsArgs good_counts() {
  DispatchCountsArgs a;
  a.num_tokens = 64;
  a.is_token_in_rank = fake<const bool>();
  a.num_tokens_per_expert = fake<const int32_t>();
  a.num_experts = 32;
  a.topk_idx = fake<const int64_t>();
  a.num_topk = 4;
  a.rank_prefix_matrix = fake<int32_t>();
  return a;
}

TEST(IntranodeCheck, ConfigNamesItsFields) {
  EXPECT_NO_THROW(intranode::check_config("dispatch", 20, 6, 256));
  expect_error([] { intranode::check_config("dispatch", 3, 6, 256); }, "dispatch", "config.num_sms");
  expect_error([] { intranode::check_config("combine", 20, 300, 256); }, "combine", "num_max_nvl_chunked_send_tokens");
}

TEST(IntranodeCheck, DispatchCounts) {
  const auto region = intranode::check_dispatch_counts(good_counts(), shape_of(4));
  EXPECT_EQ(region.num_ranks, 4);
  EXPECT_EQ(region.num_channels, 10);
  EXPECT_EQ(region.num_local_experts, 8);
  auto with = [](auto change, size_t bytes = size_t{1} << 30) {
    DispatchCountsArgs a = good_counts();
    change(a);
    return [a, bytes] { intranode::check_dispatch_counts(a, shape_of(4, bytes)); };
  };
  const std::string op = "dispatch";
  expect_error(with([](DispatchCountsArgs& a) { a.num_tokens = -2; }), op, "num_tokens");
  expect_error(with([](DispatchCountsArgs& a) { a.is_token_in_rank = nullptr; }), op, "is_token_in_rank");
  expect_error(with([](DispatchCountsArgs& a) { a.expert_alignment = 0; }), op, "expert_alignment");
  expect_error(with([](DispatchCountsArgs& a) { a.num_worst_tokens = -1; }), op, "num_worst_tokens");
  expect_error(with([](DispatchCountsArgs& a) { a.rank_prefix_matrix = nullptr; }), op, "rank_prefix_matrix");
  expect_error(with([](DispatchCountsArgs& a) { a.topk_idx = nullptr; }), op, "topk_idx");
  expect_error(with([](DispatchCountsArgs& a) { a.num_experts = 30; }), op, "num_experts");
  expect_error(with([](DispatchCountsArgs&) {}, 64), op, "num_nvl_bytes");
}

DispatchArgs good_dispatch() {
  DispatchArgs a;
  a.x = fake<const void>();
  a.num_tokens = 64;
  a.row_bytes = 7168 * 2;
  a.topk_idx = fake<const int64_t>();
  a.topk_weights = fake<const float>();
  a.num_topk = 8;
  a.num_experts = 64;
  a.is_token_in_rank = fake<const bool>();
  a.rank_prefix_matrix = fake<const int32_t>();
  a.num_recv_rows = 100;
  a.out.recv_x = fake<void>();
  a.out.recv_topk_idx = fake<int64_t>();
  a.out.recv_topk_weights = fake<float>();
  a.out.recv_src_idx = fake<int32_t>();
  return a;
}

TEST(IntranodeCheck, Dispatch) {
  const auto plan = intranode::check_dispatch(good_dispatch(), shape_of(8));
  EXPECT_GE(plan.slot.bytes, 7168 * 2);
  EXPECT_EQ(plan.region.slot_bytes, plan.slot.bytes);
  EXPECT_EQ(plan.slot.bytes % kernels::kRingSlotAlign, 0);
  auto with = [](auto change, size_t bytes = size_t{1} << 30) {
    DispatchArgs a = good_dispatch();
    change(a);
    return [a, bytes] { intranode::check_dispatch(a, shape_of(8, bytes)); };
  };
  const std::string op = "dispatch";
  expect_error(with([](DispatchArgs& a) { a.row_bytes = 100; }), op, "row of x");
  expect_error(with([](DispatchArgs& a) { a.num_scales = 56; }), op, "x_scales");
  expect_error(with([](DispatchArgs& a) { a.num_topk = kMaxTopk + 1; }), op, "num_topk");
  expect_error(with([](DispatchArgs& a) { a.topk_weights = nullptr; }), op, "topk_weights");
  expect_error(with([](DispatchArgs& a) { a.num_experts = 12; }), op, "num_experts");
  expect_error(with([](DispatchArgs& a) { a.x = fake<const void>(8); }), op, "x must start");
  expect_error(with([](DispatchArgs& a) { a.out.recv_x = fake<void>(4); }), op, "recv_x must start");
  expect_error(with([](DispatchArgs& a) { a.out.recv_x = nullptr; }), op, "recv_x");
  expect_error(with([](DispatchArgs& a) { a.out.recv_topk_weights = nullptr; }), op, "recv_topk_weights");
  expect_error(with([](DispatchArgs& a) {
                 a.num_worst_tokens = 100;
                 a.out.recv_src_idx = nullptr;
               }),
               op, "recv_src_idx");
  expect_error(with([](DispatchArgs&) {}, 1 << 20), op, "num_nvl_bytes is too small");
}

CombineArgs good_combine() {
  CombineArgs a;
  a.x = fake<const void>();
  a.num_rows = 100;
  a.hidden = 7168;
  a.topk_weights = fake<const float>();
  a.num_topk = 8;
  a.rank_prefix_matrix = fake<const int32_t>();
  a.source_num_tokens = fake<const int32_t>();
  a.recv_src_idx = fake<const int32_t>();
  a.is_token_in_rank = fake<const bool>();
  a.num_tokens = 64;
  a.combined_x = fake<void>();
  a.combined_topk_weights = fake<float>();
  return a;
}

TEST(IntranodeCheck, Combine) {
  EXPECT_NO_THROW(intranode::check_combine(good_combine(), shape_of(2)));
  EXPECT_EQ(intranode::check_combine(good_combine(), shape_of(2)).slot.bytes % kernels::kRingSlotAlign, 0);
  auto with = [](auto change, size_t bytes = size_t{1} << 30) {
    CombineArgs a = good_combine();
    change(a);
    return [a, bytes] { intranode::check_combine(a, shape_of(2, bytes)); };
  };
  const std::string op = "combine";
  expect_error(with([](CombineArgs& a) { a.hidden = 7170; }), op, "hidden");
  expect_error(with([](CombineArgs& a) { a.num_rows = -1; }), op, "num_rows");
  expect_error(with([](CombineArgs& a) { a.combined_topk_weights = nullptr; }), op, "combined_topk_weights");
  expect_error(with([](CombineArgs& a) { a.source_num_tokens = nullptr; }), op, "rank_prefix_matrix and counts");
  expect_error(with([](CombineArgs& a) { a.recv_src_idx = nullptr; }), op, "recv_src_idx");
  expect_error(with([](CombineArgs& a) { a.is_token_in_rank = nullptr; }), op, "is_token_in_rank");
  expect_error(with([](CombineArgs& a) { a.bias0 = fake<const void>(2); }), op, "16-byte aligned");
  expect_error(with([](CombineArgs&) {}, 4096), op, "num_nvl_bytes is too small");
}

}  // namespace
