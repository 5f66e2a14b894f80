#include <string>

#include "ops/low_latency/low_latency.hpp"
#include "ops/require.hpp"
#include "runtime/align.hpp"

namespace turnout::low_latency {

namespace {

using ops::require;

void check_dispatch(const LowLatencyDispatchArgs& a) {
  const char* op = "low_latency_dispatch";
  require(a.num_tokens >= 0 && a.num_tokens <= a.num_max_tokens, op, [&] {
    return "x has " + std::to_string(a.num_tokens) +
           " tokens, more than num_max_dispatch_tokens_per_rank=" + std::to_string(a.num_max_tokens);
  });
  require(a.num_tokens == 0 || (a.x && is_aligned(a.x, 16)), op, "x must be a 16-byte aligned device pointer");
  require(a.num_tokens == 0 || a.topk_idx, op, "topk_idx must not be null");
  require(!a.use_fp8 || a.hidden % kLowLatencyScaleGroup == 0, op, [&] {
    return "hidden must be a multiple of 128 with use_fp8 (bf16 takes any multiple of 8), got " +
           std::to_string(a.hidden);
  });
  require(!a.use_ue8m0 || (a.use_fp8 && a.round_scale), op, "use_ue8m0 needs use_fp8=True and round_scale=True");
  require(a.recv_x && is_aligned(a.recv_x, 16), op, "recv_x must be a 16-byte aligned device pointer");
  require(a.recv_count && a.src_info && a.layout_range, op, "recv_count, src_info and layout_range must not be null");
  require(a.plan && is_aligned(a.plan, 16), op, "plan must be a 16-byte aligned device pointer");
  require(!a.use_fp8 || a.use_ue8m0 || a.recv_scales, op, "recv_scales must not be null with use_fp8");
  require(!a.use_ue8m0 || a.recv_packed_scales, op, "recv_packed_scales must not be null with use_ue8m0");
}

}  // namespace

void dispatch(BufferCore& core, const LowLatencyDispatchArgs& args, LowLatencyPhase phase, cudaStream_t stream) {
  const char* op = "low_latency_dispatch";
  const OpShape shape = begin_op(core, op, OpKind::kLowLatencyDispatch, args.num_max_tokens, args.hidden,
                                 args.num_experts, args.num_topk);
  check_dispatch(args);
  if (const NvshmemApi* nvshmem = core.low_latency_nvshmem())
    nvshmem_check(*nvshmem,
                  nvshmem->low_latency_dispatch(&args, &shape.region, &shape.group, static_cast<int>(phase), stream),
                  op);
  else
    kernels::low_latency::launch_dispatch(args, shape.region, shape.group, phase, stream);
  core.check_errors(op);
}

}  // namespace turnout::low_latency
