#include <string>

#include "ops/low_latency/low_latency.hpp"
#include "ops/require.hpp"
#include "runtime/align.hpp"

namespace turnout::low_latency {

namespace {

using ops::require;

void check_combine(const LowLatencyCombineArgs& a) {
  const char* op = "low_latency_combine";
  require(a.num_tokens >= 0 && a.num_tokens <= a.num_max_tokens, op, [&] {
    return "topk_idx has " + std::to_string(a.num_tokens) +
           " tokens, more than num_max_dispatch_tokens_per_rank=" + std::to_string(a.num_max_tokens);
  });
  require(a.x && is_aligned(a.x, 16), op, "x must be a 16-byte aligned device pointer");
  require(a.num_tokens == 0 || (a.topk_idx && a.topk_weights), op, "topk_idx and topk_weights must not be null");
  require(a.plan && is_aligned(a.plan, 16), op, "the handle's plan must be a 16-byte aligned device pointer");
  require(a.num_tokens == 0 || (a.out && is_aligned(a.out, 16)), op, "out must be a 16-byte aligned device pointer");
  require(!a.use_logfmt || a.hidden % kLowLatencyScaleGroup == 0, op,
          [&] { return "use_logfmt needs hidden to be a multiple of 128, got " + std::to_string(a.hidden); });
}

}  // namespace

void combine(BufferCore& core, const LowLatencyCombineArgs& args, LowLatencyPhase phase, cudaStream_t stream) {
  const char* op = "low_latency_combine";
  const OpShape shape =
      begin_op(core, op, OpKind::kLowLatencyCombine, args.num_max_tokens, args.hidden, args.num_experts, args.num_topk);
  check_combine(args);
  if (const NvshmemApi* nvshmem = core.low_latency_nvshmem())
    nvshmem_check(*nvshmem,
                  nvshmem->low_latency_combine(&args, &shape.region, &shape.group, static_cast<int>(phase), stream),
                  op);
  else
    kernels::low_latency::launch_combine(args, shape.region, shape.group, phase, stream);
  core.check_errors(op);
}

}  // namespace turnout::low_latency
