#include <algorithm>
#include <string>
#include <vector>

#include "ops/low_latency/low_latency.hpp"
#include "ops/require.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace turnout {

size_t low_latency_required_bytes(int num_max_tokens, int hidden, int num_ranks, int num_topk) {
  return static_cast<size_t>(kernels::low_latency::make_region(num_max_tokens, hidden, num_ranks, num_topk).total);
}

size_t low_latency_plan_bytes(int num_max_tokens, int num_ranks, int num_experts) {
  return static_cast<size_t>(kernels::low_latency::make_plan(num_max_tokens, num_ranks, num_experts).total);
}

LowLatencyRegionOffsets low_latency_region_offsets(int num_max_tokens, int hidden, int num_ranks) {
  const auto r = kernels::low_latency::make_region(num_max_tokens, hidden, num_ranks, kLowLatencyMaxTopk);
  return {r.message, {r.dispatch_data[0], r.dispatch_data[1]}, {r.weights[0], r.weights[1]}};
}

namespace low_latency {

OpShape begin_op(BufferCore& core, const char* op, OpKind kind, int num_max_tokens, int hidden, int num_experts,
                 int num_topk) {
  using ops::require;
  using ops::str;
  core.require_alive(op);
  if (!core.options().low_latency_mode)
    throw InvalidArgument(std::string(op) + ": this buffer was created without low_latency_mode=True");
  if (core.timed_out()) core.check_errors(op);
  // The group is every rank, in one NVL domain or across several.
  const int R = core.topology().num_ranks;
  require(num_max_tokens >= 1 && num_max_tokens <= kLowLatencyMaxTokens, op, [&] {
    return "num_max_dispatch_tokens_per_rank must be in [1, " + str(kLowLatencyMaxTokens) + "], got " +
           str(num_max_tokens);
  });
  require(hidden >= 8 && hidden <= kLowLatencyMaxHidden && hidden % 8 == 0, op, [&] {
    return "hidden must be a multiple of 8 in [8, " + str(kLowLatencyMaxHidden) + "], got " + str(hidden);
  });
  require(num_experts >= R && num_experts <= kLowLatencyMaxExperts && num_experts % R == 0, op, [&] {
    return "num_experts must be a multiple of the group size " + str(R) + " in [" + str(R) + ", " +
           str(kLowLatencyMaxExperts) + "], got " + str(num_experts);
  });
  require(num_topk >= 1 && num_topk <= kLowLatencyMaxTopk, op,
          [&] { return "topk_idx must have 1 to " + str(kLowLatencyMaxTopk) + " columns, got " + str(num_topk); });
  OpShape shape;
  shape.region = kernels::low_latency::make_region(num_max_tokens, hidden, R, num_topk);
  require(static_cast<size_t>(shape.region.total) <= core.low_latency_bytes(), op, [&] {
    return "num_rdma_bytes is too small for this call: it needs " + str(shape.region.total) +
           " bytes (M=" + str(num_max_tokens) + ", hidden=" + str(hidden) + ", " + str(R) + " ranks, top-" +
           str(num_topk) + "), the buffer has " + str(static_cast<int64_t>(core.low_latency_bytes())) +
           "; size it with get_low_latency_rdma_size_hint";
  });
  shape.group.regions = core.low_latency_table();
  const std::vector<void*>& regions = core.low_latency_regions();
  if (R <= kernels::low_latency::kRegionsByValue)
    std::copy(regions.begin(), regions.end(), shape.group.regions_by_value);
  shape.group.rank = core.topology().rank;
  shape.group.num_ranks = R;
  shape.group.num_blocks = core.sm_budget();
  shape.group.gpu_to_itself = core.ranks_on_gpu() == 1;
  core.begin_call();
  shape.group.wait = core.wait_context(kind, true);
  // A combine may wait for an expert rank that itself waits out a dead
  // source's weights: its patience is twice theirs, so it never masks a live
  // rank for that, nor (without shrink mode) names one: the first timeout a
  // rank records names the rank that did not come (a weights wait's, or the
  // receive's own after two timeouts where this rank waits for no weights).
  shape.group.receive_wait = core.wait_context(kind, true, 2);
  return shape;
}

}  // namespace low_latency
}  // namespace turnout
