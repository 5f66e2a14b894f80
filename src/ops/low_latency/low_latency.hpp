// Low-latency mode behind the Buffer facade. It keeps no host state of its
// own: call numbers live on the device (kernels/low_latency/region.hpp), so
// CUDA-graph replays and eager calls mix freely.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "kernels/low_latency/launch.hpp"
#include "ops/buffer_core.hpp"
#include "turnout/low_latency.hpp"

namespace turnout::low_latency {

// What every low-latency op checks first: a live buffer in low-latency mode
// with no timeout, and a call shape (M, hidden, E, K) within the bounds that
// fits the buffer. Returns the region of that shape and the group to launch on.
struct OpShape {
  kernels::low_latency::Region region;
  kernels::low_latency::Group group;
};
OpShape begin_op(BufferCore& core, const char* op, OpKind kind, int num_max_tokens, int hidden, int num_experts,
                 int num_topk);

// Input errors of earlier calls are raised after the launches (see
// turnout/buffer.hpp), so that no peer waits for a kernel this rank skipped.
void dispatch(BufferCore& core, const LowLatencyDispatchArgs& args, LowLatencyPhase phase, cudaStream_t stream);
void combine(BufferCore& core, const LowLatencyCombineArgs& args, LowLatencyPhase phase, cudaStream_t stream);
// Collective: every rank meets, the region is zeroed and its call numbers
// start again at first_call, every rank meets again.
void clean(BufferCore& core, cudaStream_t stream, uint64_t first_call);
// The number of the last call of each phase that finished (dispatch send,
// dispatch receive, combine send, combine receive); a synchronous copy.
std::array<uint64_t, 4> call_numbers(BufferCore& core);

}  // namespace turnout::low_latency
