// Host-callable launchers of the kernels. The ops layer validates arguments
// before calling these; they only size the grid and launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/wait_context.hpp"
#include "turnout/layout.hpp"

namespace turnout::kernels {

// Which kernel a launch runs and on what grid, for an op that enqueues it as
// a graph node (ops/op_graph.hpp) rather than launching it.
struct KernelLaunch {
  const void* func = nullptr;
  dim3 grid, block;
  size_t shared_bytes = 0;
};
// Launches it; `args` points at each of the kernel's parameters.
void launch(const KernelLaunch& k, void** args, cudaStream_t stream);

// A copy of `bytes` by a kernel of as many blocks as cover it in one pass
// (four 16-byte words a thread where both addresses allow): parameters
// (const char* src, char* dst, size_t bytes).
KernelLaunch copy_bytes_launch(size_t bytes);

struct LayoutParams {
  LayoutArgs args;
  int num_ranks;
  int num_nvl_ranks;
  int rank;
  DeviceErrorSlot errors;
  int32_t* workspace;   // [counters | finished blocks], zero between calls
  const int32_t* mask;  // shrink mode: int32 per rank, nonzero = masked (its experts count as -1); else null
};
void launch_dispatch_layout(const LayoutParams& p, cudaStream_t stream);

// `control` is the device table of every NVL peer's control region.
void launch_barrier(void* const* control, int nvl_rank, int num_nvl_ranks, const WaitContext& ctx, cudaStream_t stream);

// Shrink mode: stores `value` into one rank's mask word, in order on `stream`.
void launch_set_mask(int32_t* word, int32_t value, cudaStream_t stream);

// `peers`: device table of NVL peers' user buffers; `threads` a block (a
// multiple of 32, at most 1024); `words_in_flight` 16-byte loads a lane
// before their stores (1, 2, 4 or 8).
void launch_store_to_peers(void* const* peers, int nvl_rank, int num_nvl_ranks, const void* src, size_t bytes,
                           size_t dst_offset, bool include_self, int num_sms, int threads, int words_in_flight,
                           cudaStream_t stream);
// The same with bulk copies through shared memory (sm_90).
void launch_store_to_peers_bulk(void* const* peers, int nvl_rank, int num_nvl_ranks, const void* src, size_t bytes,
                                size_t dst_offset, bool include_self, int num_sms, cudaStream_t stream);
// The reverse: every lane reads `words_in_flight` 16-byte words a peer (1, 2,
// 4, 8, or 16 with at most 512 threads) before storing them into dst + peer *
// bytes.
void launch_load_from_peers(void* const* peers, int nvl_rank, int num_nvl_ranks, void* dst, size_t bytes,
                            size_t src_offset, bool include_self, int num_sms, int threads, int words_in_flight,
                            cudaStream_t stream);

}  // namespace turnout::kernels
