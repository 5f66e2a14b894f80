// What the internode kernels take. The ops layer has checked the arguments
// and sized both regions; the launchers (in libturnout_nvshmem.so, reached
// through the NVSHMEM API table) only pack parameters and launch.
#pragma once

#include <cstdint>

#include "kernels/internode/region.hpp"
#include "kernels/intranode/launch.hpp"
#include "kernels/wait_context.hpp"
#include "turnout/internode.hpp"

namespace turnout::kernels::internode {

// Where the counts step leaves the receive sizes for the host (host-mapped,
// the intranode mailbox's memory). The host picks a new `sequence` per call
// and spins until the kernel has written it, after the counts.
struct CountsMailbox {
  int32_t sequence;
  int32_t failed;  // a bad input on some rank: every rank skips the data step
  int32_t num_recv_tokens;
  int32_t num_forward_tokens;
  int32_t num_parts;                      // P: the columns this rank forwards (1 without shrink mode)
  int32_t num_recv_tokens_per_expert[1];  // [L], really
};
inline constexpr int kMaxMailboxExperts = (kMailboxBytes - 20) / 4;
// Words of a live set (a bit per rank) of the largest internode group.
inline constexpr int kMaxLiveWords = (kMaxDomains * kMaxNvlRanks + 31) / 32;

struct Peers {
  void* const* control;  // device table of NVL peers' control regions
  void* const* buffers;  // device table of NVL peers' user buffers
  int rank;              // global
  int num_ranks;         // R
  int num_nvl_ranks;     // D
};

// The counts step runs as two launches of one kernel: kCount, a block per
// channel, counts this rank's tokens per (rank, channel) and (domain,
// channel) into the handle's [2] and [1] and checks the expert ids; then
// kExchange, one block, meets the peers, resets the rings and exchanges the
// counts (docs/INTERNODE.md "Counts step"). Without `exchange_counts` (a
// cached dispatch, a combine) kExchange only meets the peers and resets.
enum class NotifyPhase : int32_t { kCount = 0, kExchange = 1 };

struct NotifyParams {
  Peers peers;
  NetRegion net;
  NvlRegion nvl;
  char* net_local;  // this rank's network region
  bool exchange_counts;
  InternodeDispatchCountsArgs counts;  // with exchange_counts
  CountsMailbox* mailbox;              // device view of host-mapped memory, or null (no host wait)
  int32_t sequence;
  // Shrink mode (null without): the buffer's rank mask, int32 per global
  // rank, read as the call starts (ranks masked before the call). A fresh
  // dispatch judges the others under shrink_timeout_ns, agrees with the
  // survivors on who takes part (live_set.hpp) and masks the rest here; its
  // later waits, and those of a cached dispatch, keep ctx's plain timeouts.
  int32_t* mask;
  // A shrink-mode combine's is judged (ctx.mask set, shrink timeout): each
  // of its waits masks a peer that does not come and goes on without it.
  WaitContext ctx;
  uint64_t shrink_timeout_ns;
};

// The dispatch data step: a pair of blocks per channel. The send block holds
// a sender warp per destination domain and a receiver warp per forwarder of
// this domain; the forward block a forwarder warp per source domain (docs/
// INTERNODE.md "Data step"). So a block has N + D warps at most.
struct DispatchParams {
  Peers peers;
  NetRegion net;
  NvlRegion nvl;
  DispatchSlot slot;  // network and NVL slots alike
  char* net_local;
  InternodeDispatchArgs args;
  int experts_per_rank;  // L (0 without top-k)
  WaitContext ctx;
};

__host__ __device__ inline int dispatch_block_warps(int num_domains, int num_nvl_ranks) {
  return num_domains + num_nvl_ranks;
}

// The combine data step: dispatch's pairs of blocks backwards. The send
// block holds a sender warp per forwarder of this domain, the forward block a
// warp per other domain (partial sums) and one for this domain (the final
// sums): max(N, D) warps. In shrink mode ctx is judged (mask, shrink
// timeout): a peer gone since the dispatch is left out (combine.cuh).
struct CombineParams {
  Peers peers;
  NetRegion net;
  NvlRegion nvl;
  CombineSlot slot;  // network and NVL slots alike
  char* net_local;
  InternodeCombineArgs args;
  WaitContext ctx;
};

}  // namespace turnout::kernels::internode
