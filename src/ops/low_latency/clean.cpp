#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/low_latency/region.hpp"
#include "ops/low_latency/low_latency.hpp"
#include "turnout/error.hpp"

namespace turnout::low_latency {
namespace {

namespace region = kernels::low_latency;

// The zeroed fixed area as after call first_call - 1 of every phase: each
// call counter holds that number, each source's arrival counter of a parity
// what that parity's calls up to it added, and each shrink-mode verdict that
// call's, counted (a zeroed verdict would read, at a tag of 2^31, as the first
// call's, not counted). Nothing else of an earlier call is needed to tell the
// next calls apart.
void start_calls_at(void* fixed_area, uint64_t first_call, cudaStream_t stream) {
  const uint64_t last = first_call - 1;
  region::LocalState local{};
  for (region::CallCounter* c : {&local.dispatch_send, &local.dispatch_recv, &local.combine_send, &local.combine_recv})
    c->seq = last;
  const uint32_t verdict = region::verdict_after(last);
  for (int r = 0; r < region::kMaxGroupRanks; ++r) local.dispatch_verdict[r] = local.combine_verdict[r] = verdict;
  const uint32_t arrivals[2] = {region::arrivals_through(last, 0), region::arrivals_through(last, 1)};
  std::vector<region::DispatchSignal> dispatch(2 * region::kMaxGroupRanks);
  std::vector<region::CombineSignal> combine(2 * region::kMaxGroupRanks);
  for (int i = 0; i < 2 * region::kMaxGroupRanks; ++i) {
    dispatch[i].arrivals = arrivals[i / region::kMaxGroupRanks];
    combine[i].arrivals = arrivals[i / region::kMaxGroupRanks];
  }
  auto* base = static_cast<char*>(fixed_area);
  TURNOUT_CUDA_CHECK(cudaMemcpyAsync(base + offsetof(region::FixedArea, local), &local, sizeof(local),
                                     cudaMemcpyHostToDevice, stream));
  TURNOUT_CUDA_CHECK(cudaMemcpyAsync(base + offsetof(region::FixedArea, dispatch), dispatch.data(),
                                     dispatch.size() * sizeof(dispatch[0]), cudaMemcpyHostToDevice, stream));
  TURNOUT_CUDA_CHECK(cudaMemcpyAsync(base + offsetof(region::FixedArea, combine), combine.data(),
                                     combine.size() * sizeof(combine[0]), cudaMemcpyHostToDevice, stream));
  // Pageable sources: the copies must be done before the vectors go.
  TURNOUT_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace

std::array<uint64_t, 4> call_numbers(BufferCore& core) {
  const char* op = "low_latency_call_numbers";
  core.require_alive(op);
  if (!core.options().low_latency_mode)
    throw InvalidArgument(std::string(op) + ": this buffer was created without low_latency_mode=True");
  region::LocalState local;
  TURNOUT_CUDA_CHECK(cudaMemcpy(&local,
                                static_cast<const char*>(core.local_low_latency()) + offsetof(region::FixedArea, local),
                                sizeof(local), cudaMemcpyDeviceToHost));
  return {local.dispatch_send.seq, local.dispatch_recv.seq, local.combine_send.seq, local.combine_recv.seq};
}

void clean(BufferCore& core, cudaStream_t stream, uint64_t first_call) {
  const char* op = "clean_low_latency_buffer";
  core.require_alive(op);
  if (!core.options().low_latency_mode)
    throw InvalidArgument(std::string(op) + ": this buffer was created without low_latency_mode=True");
  if (first_call < 1) throw InvalidArgument(std::string(op) + ": first_call must be >= 1, got 0");
  // Everything, the call counters and arrival counters too: every rank starts
  // again from call first_call (1 unless a test asks for another) with
  // nothing of an earlier call left to pass for a later one's (no stale tag
  // survives either). In shrink mode the unmasked ranks meet, and one that
  // does not come is masked.
  core.barrier(stream, true);
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(core.local_low_latency(), 0, core.low_latency_bytes(), stream));
  if (first_call > 1) start_calls_at(core.local_low_latency(), first_call, stream);
  core.barrier(stream, true);
  core.check_errors(op);
}

}  // namespace turnout::low_latency
