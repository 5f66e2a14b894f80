#include "ops/intranode/check.hpp"

#include <cstdint>
#include <string>

#include "kernels/intranode/launch.hpp"
#include "ops/require.hpp"
#include "runtime/align.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace turnout::intranode {
namespace {

using ops::check_num_experts;
using ops::check_num_topk;
using ops::require;
using ops::str;

kernels::IntranodeRegion dispatch_region(const BufferShape& shape, int num_experts, int recv_tokens, int slot_bytes) {
  return kernels::make_intranode_region(shape.num_ranks, shape.num_sms / 2, num_experts / shape.num_ranks, recv_tokens,
                                        slot_bytes);
}

void check_fits(const char* op, const kernels::IntranodeRegion& region, size_t num_nvl_bytes) {
  if (static_cast<size_t>(region.total) > num_nvl_bytes)
    throw InvalidArgument(std::string(op) + ": num_nvl_bytes is too small for this call: it needs " +
                          str(region.total) + " bytes (" + str(region.num_channels) + " channels x " +
                          str(region.num_ranks) + " ranks x " + str(region.ring_slots) + " slots of " +
                          str(region.slot_bytes) + " bytes, plus counts), the buffer has " +
                          str(static_cast<int64_t>(num_nvl_bytes)) + "; size it with Config.get_nvl_buffer_size_hint");
}

}  // namespace

void check_config(const char* op, int num_sms, int send_tokens, int recv_tokens) {
  require(num_sms >= 2 && num_sms % 2 == 0 && num_sms / 2 <= kernels::kMaxChannels, op, [&] {
    return "config.num_sms must be even and in [2, " + str(2 * kernels::kMaxChannels) + "], got " + str(num_sms);
  });
  require(send_tokens >= 1 && send_tokens <= recv_tokens, op, [&] {
    return "config needs 1 <= num_max_nvl_chunked_send_tokens <= num_max_nvl_chunked_recv_tokens, got " +
           str(send_tokens) + " and " + str(recv_tokens);
  });
}

kernels::IntranodeRegion check_dispatch_counts(const DispatchCountsArgs& a, const BufferShape& shape) {
  const char* op = "dispatch";
  const int R = shape.num_ranks;
  require(a.num_tokens >= 0, op, [&] { return "num_tokens must be >= 0, got " + str(a.num_tokens); });
  require(a.num_tokens == 0 || a.is_token_in_rank, op, "is_token_in_rank must be given");
  require(a.expert_alignment >= 1, op, [&] { return "expert_alignment must be >= 1, got " + str(a.expert_alignment); });
  require(a.num_worst_tokens >= 0, op, [&] { return "num_worst_tokens must be >= 0, got " + str(a.num_worst_tokens); });
  require(a.rank_prefix_matrix != nullptr, op, "rank_prefix_matrix must be given");
  require(a.num_topk >= 0 && a.num_topk <= kMaxTopk && (a.num_topk == 0 || a.num_tokens == 0 || a.topk_idx), op,
          [&] { return "num_topk must be in [0, " + str(kMaxTopk) + "] with topk_idx given, got " + str(a.num_topk); });
  if (a.num_tokens_per_expert || a.num_topk > 0) {
    check_num_experts(op, a.num_experts, R);
    require(a.num_experts / R <= kernels::kMaxMailboxExperts, op, [&] {
      return "at most " + str(kernels::kMaxMailboxExperts) + " experts per rank, got " + str(a.num_experts / R);
    });
  }
  // Only the counts area is used here; the data step checks the rings.
  const int experts = a.num_tokens_per_expert ? a.num_experts : 0;
  const auto region = dispatch_region(shape, experts, a.num_max_recv_tokens, 16);
  require(region.rings <= kernels::kIntranodeMetaBytes, op, [&] {
    return "the counts of " + str(experts) + " experts over " + str(shape.num_sms / 2) + " channels exceed " +
           str(kernels::kIntranodeMetaBytes) + " bytes";
  });
  require(static_cast<size_t>(region.rings) <= shape.num_nvl_bytes, op, [&] {
    return "num_nvl_bytes is too small for this call: it needs at least " + str(region.rings) +
           " bytes, the buffer has " + str(static_cast<int64_t>(shape.num_nvl_bytes));
  });
  return region;
}

DispatchPlan check_dispatch(const DispatchArgs& a, const BufferShape& shape) {
  const char* op = "dispatch";
  require(a.num_tokens >= 0, op, [&] { return "num_tokens must be >= 0, got " + str(a.num_tokens); });
  require(a.row_bytes > 0 && a.row_bytes % 16 == 0, op,
          [&] { return "the row of x must be a positive multiple of 16 bytes, got " + str(a.row_bytes); });
  // Empty tensors may have null pointers: only rows that exist need one.
  require(a.num_scales >= 0 && (a.num_scales == 0 || a.num_tokens == 0 || a.x_scales), op,
          "x_scales must be given with num_scales > 0");
  check_num_topk(op, a.num_topk);
  if (a.num_topk > 0) {
    require(a.num_tokens == 0 || (a.topk_idx && a.topk_weights), op,
            "topk_idx and topk_weights must be given together");
    check_num_experts(op, a.num_experts, shape.num_ranks);
  }
  require(a.num_tokens == 0 || (a.x && a.is_token_in_rank), op, "x and is_token_in_rank must be given");
  require(a.rank_prefix_matrix != nullptr, op, "rank_prefix_matrix must be given");
  require(is_aligned(a.x, 16), op, "x must start at a 16-byte aligned address");
  const DispatchOutputs& o = a.out;
  require(a.num_recv_rows >= 0, op, "num_recv_rows must be >= 0");
  require(a.num_recv_rows == 0 || o.recv_x, op, "recv_x must be given");
  require(a.num_worst_tokens == 0 || a.num_recv_rows == 0 || o.recv_src_idx, op,
          "recv_src_idx must be given with num_worst_tokens (its padding rows are marked -1)");
  require(a.num_scales == 0 || a.num_recv_rows == 0 || o.recv_x_scales, op, "recv_x_scales must be given with scales");
  require(a.num_topk == 0 || a.num_recv_rows == 0 || (o.recv_topk_idx && o.recv_topk_weights), op,
          "recv_topk_idx and recv_topk_weights must be given with top-k");
  require(is_aligned(o.recv_x, 16), op, "recv_x must start at a 16-byte aligned address");
  DispatchPlan plan;
  plan.slot = kernels::make_dispatch_slot(a.row_bytes, a.num_scales, a.num_topk);
  plan.slot.bytes = kernels::ring_slot_bytes(plan.slot.bytes);
  plan.region = dispatch_region(shape, a.num_topk > 0 ? a.num_experts : 0, a.num_max_recv_tokens, plan.slot.bytes);
  check_fits(op, plan.region, shape.num_nvl_bytes);
  return plan;
}

CombinePlan check_combine(const CombineArgs& a, const BufferShape& shape) {
  const char* op = "combine";
  require(a.hidden > 0 && a.hidden % 8 == 0, op,
          [&] { return "hidden must be a positive multiple of 8, got " + str(a.hidden); });
  require(a.num_rows >= 0 && a.num_tokens >= 0, op, "num_rows and num_tokens must be >= 0");
  check_num_topk(op, a.num_topk);
  require(a.num_topk == 0 || ((a.num_rows == 0 || a.topk_weights) && (a.num_tokens == 0 || a.combined_topk_weights)),
          op, "topk_weights and combined_topk_weights must be given together");
  require(a.rank_prefix_matrix && a.source_num_tokens, op, "the handle's rank_prefix_matrix and counts must be given");
  require(a.num_rows == 0 || (a.x && a.recv_src_idx), op, "x and the handle's recv_src_idx must be given");
  require(a.num_tokens == 0 || (a.combined_x && a.is_token_in_rank), op,
          "combined_x and the handle's is_token_in_rank must be given");
  require(is_aligned(a.x, 16) && is_aligned(a.combined_x, 16) && is_aligned(a.bias0, 16) && is_aligned(a.bias1, 16), op,
          "x, combined_x and the biases must start at a 16-byte aligned address");
  CombinePlan plan;
  plan.slot = kernels::make_combine_slot(a.hidden, a.num_topk);
  plan.slot.bytes = kernels::ring_slot_bytes(plan.slot.bytes);
  plan.region =
      kernels::make_intranode_region(shape.num_ranks, shape.num_sms / 2, 0, a.num_max_recv_tokens, plan.slot.bytes);
  check_fits(op, plan.region, shape.num_nvl_bytes);
  return plan;
}

}  // namespace turnout::intranode
