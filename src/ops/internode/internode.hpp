// Internode normal mode behind the Buffer facade: dispatch (counts step, then
// data step) and combine over several NVL domains (docs/INTERNODE.md). The
// argument checks are free functions (check.hpp); this is the state of the
// mode and its ops. The kernels live in libturnout_nvshmem.so, reached
// through the core's NVSHMEM table.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/internode/launch.hpp"
#include "ops/buffer_core.hpp"
#include "ops/internode/check.hpp"
#include "ops/intranode/intranode.hpp"
#include "turnout/internode.hpp"

namespace turnout::internode {

// The mode's host state: where its counts step leaves the receive sizes
// (the intranode mailbox's memory and sequence, a mailbox of its own).
struct State {
  intranode::CountsMailbox mailbox;
  void release() { mailbox.release(); }
};

// What every op of the mode does first: a live buffer, no timeout, a group
// that spans NVL domains with its network region open. The call runs on the
// config's SMs, at most the budget (every block must be resident at once).
BufferShape begin_op(BufferCore& core, const char* op, const Config& config);

// The counts step's parameters on this buffer (`exchange_counts` false: a
// cached dispatch or a combine, which only meet the peers and reset).
kernels::internode::NotifyParams notify_params(BufferCore& core, const Regions& regions, bool exchange_counts,
                                               const InternodeDispatchCountsArgs& counts, OpKind op);
// Launches it through the NVSHMEM table; an error there throws naming `op`.
void launch_notify(BufferCore& core, const kernels::internode::NotifyParams& params, const char* op,
                   cudaStream_t stream);

// Step 1 of a dispatch: exchange the counts; unless num_worst_tokens > 0 or
// the dispatch is cached, wait for them on the host.
InternodeDispatchCounts dispatch_counts(BufferCore& core, State& state, const InternodeDispatchCountsArgs& args,
                                        cudaStream_t stream);
// Step 2: move the tokens.
void dispatch(BufferCore& core, const InternodeDispatchArgs& args, cudaStream_t stream);
void combine(BufferCore& core, const InternodeCombineArgs& args, cudaStream_t stream);

}  // namespace turnout::internode
