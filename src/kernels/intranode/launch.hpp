// Launchers of the intranode kernels. The ops layer has checked the arguments
// and sized the region; these only pack parameters and launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/intranode/combine_stage.hpp"
#include "kernels/intranode/landing.hpp"
#include "kernels/intranode/region.hpp"
#include "kernels/launch.hpp"
#include "kernels/wait_context.hpp"
#include "turnout/intranode.hpp"

namespace turnout::kernels {

// Where the counts step leaves the receive sizes for the host (host-mapped).
// The host picks a new `sequence` per call and spins until the kernel has
// written it, after the counts.
struct RecvCountsMailbox {
  int32_t sequence;
  int32_t failed;  // a bad input on some rank: every rank skips the data step
  int32_t num_recv_tokens;
  int32_t max_recv_tokens;                // the most any rank receives
  int32_t own_rows_begin;                 // rows from the ranks before this one
  int32_t own_rows;                       // rows this rank sends itself
  int32_t num_recv_tokens_per_expert[1];  // [L], really
};
inline constexpr int64_t kMailboxBytes = 64 * 1024;
inline constexpr int kMaxMailboxExperts =
    static_cast<int>((kMailboxBytes - offsetof(RecvCountsMailbox, num_recv_tokens_per_expert)) / sizeof(int32_t));

// The grid limits: one channel is a send block and a receive block.
inline constexpr int kMaxChannels = 128;

struct Peers {
  void* const* control;  // device table of NVL peers' control regions
  void* const* buffers;  // device table of NVL peers' user buffers
  int rank;              // this rank (one NVL domain: its index there too)
  int num_ranks;
};

// What combine's step before the data checks of its handle.
struct HandleCheck {
  const int32_t* rank_prefix_matrix;
  const int32_t* source_num_tokens;
  int num_rows;    // rows of combine's x
  int num_tokens;  // rows of is_token_in_rank
  int stage_tag;   // 0, or 1 + the parity of the combine stage holding this rank's rows
  // The rows from itself the stage skipped, [begin, begin + rows) (begin -1: none).
  int skipped_begin;
  int skipped_rows;
  // The top-k weights (num_stage_weights floats) the step copies into this
  // rank's stage at stage_weights_at of its buffer; -1: none.
  const float* stage_weights;
  int64_t stage_weights_at;
  int64_t num_stage_weights;
};

// Meets the peers, resets this rank's ring counters, and (with `counts`)
// exchanges the counts of a dispatch; the mailbox (may be null) gets the
// receive sizes. Without `counts` it prepares the rings of a combine and
// checks its handle. Either way every rank learns whether some rank's input
// was bad (then every rank's data step skips: the region's status).
struct NotifyParams {
  Peers peers;
  IntranodeRegion region;
  bool exchange_counts;
  DispatchCountsArgs counts;
  HandleCheck handle;
  RecvCountsMailbox* mailbox;  // device view of host-mapped memory, or null
  int32_t sequence;
  WaitContext ctx;
};
void launch_intranode_notify(const NotifyParams& p, cudaStream_t stream);
// Its kernel and grid; its one parameter is a NotifyParams.
KernelLaunch intranode_notify_launch();

struct DispatchParams {
  Peers peers;
  IntranodeRegion region;
  DispatchSlot slot;
  DispatchArgs args;
  int experts_per_rank;  // L (0 without top-k)
  WaitContext ctx;
  DispatchLanding landing;  // x >= 0: every block sends into the receivers' landing areas
};
void launch_intranode_dispatch(const DispatchParams& p, cudaStream_t stream);
// The data step through the landing areas (landing.hpp); recv_x is the caller's
// copy to make once it ends.
void launch_intranode_landing_dispatch(const DispatchParams& p, cudaStream_t stream);
KernelLaunch intranode_landing_dispatch_launch(const DispatchParams& p);
// Both in one launch, the counts step in its first block, whose other blocks
// wait for it: only where every block is resident at once (no other rank on
// the GPU), and with no host wait between the steps (mailbox null).
void launch_intranode_counts_and_dispatch(const NotifyParams& counts, const DispatchParams& p, cudaStream_t stream);
// Their kernels and grids for `p`: parameters (p), and (counts, p).
KernelLaunch intranode_dispatch_launch(const DispatchParams& p);
KernelLaunch intranode_counts_and_dispatch_launch(const DispatchParams& p);

struct CombineParams {
  Peers peers;
  IntranodeRegion region;
  CombineSlot slot;
  CombineArgs args;
  WaitContext ctx;
  // The reducer reads this rank's own rows from the input instead of the
  // sender copying them through a ring (see kOwnRowsDirectMaxChannels).
  bool own_rows_direct;
  // at >= 0: this rank's rows are staged there, and where every rank's are,
  // the blocks pull them (combine_stage.hpp).
  CombineStage stage;
};

// Up to this many channels (20 SMs) sparing combine's send blocks the own
// rows' copy pays (+4% at 20 SMs, +16% at 12 and 8, 4x H200); with more,
// reading those rows from the input rather than from a ring the sender just
// wrote costs 2% at 24 SMs, 7% at 32.
inline constexpr int kOwnRowsDirectMaxChannels = 10;
void launch_intranode_combine(const CombineParams& p, cudaStream_t stream);
// Both in one launch (the handle check in its first block): only where every
// block is resident at once (no other rank on the GPU).
void launch_intranode_check_and_combine(const NotifyParams& check, const CombineParams& p, cudaStream_t stream);
// Their kernels and grids for `p`: parameters (p), and (check, p).
KernelLaunch intranode_combine_launch(const CombineParams& p);
KernelLaunch intranode_check_and_combine_launch(const CombineParams& p);

// The token range [begin(c), begin(c + 1)) of channel c: contiguous, so the
// tokens of one channel stay in source order.
__host__ __device__ inline int channel_begin(int num_tokens, int channel, int num_channels) {
  return static_cast<int>(static_cast<int64_t>(num_tokens) * channel / num_channels);
}

// The channel whose range holds token t: the largest c with begin(c) <= t.
__host__ __device__ inline int channel_of(int token, int num_tokens, int num_channels) {
  return static_cast<int>((static_cast<int64_t>(token + 1) * num_channels - 1) / num_tokens);
}

// Tokens a sender group writes between two tail updates: the config's hint
// rounded up to a multiple of the group, so every warp copies the same number
// each round (unless that would exceed the ring).
__host__ __device__ inline int round_size(int hint, int group_warps, int ring_slots) {
  const int k = (hint + group_warps - 1) / group_warps * group_warps;
  return k <= ring_slots ? k : hint;
}

}  // namespace turnout::kernels
