// A dispatch's counts step, and its bounded host wait (as intranode's).
#include <atomic>
#include <chrono>
#include <string>

#include "kernels/internode/launch.hpp"
#include "ops/internode/internode.hpp"
#include "ops/require.hpp"
#include "turnout/error.hpp"

namespace turnout::internode {
namespace {

// Every rank learns here whether some rank's input was bad: then every rank
// raises, and none launches the data step.
InternodeDispatchCounts wait_recv_counts(BufferCore& core, intranode::CountsMailbox& mailbox, const char* op,
                                         int32_t sequence, int experts_per_rank) {
  const auto* box = static_cast<const kernels::internode::CountsMailbox*>(mailbox.host());
  const auto start = HostClock::now();
  const volatile int32_t* seen = &box->sequence;
  const bool arrived = host_wait(
      op, core.host_deadline(start), kPeerWait, [&] { return *seen == sequence; },
      [&] {
        if (core.timed_out()) core.check_errors(op);
      });
  if (!arrived)
    throw TimeoutError(std::string(op) + ": rank " + std::to_string(core.topology().rank) +
                       ": the receive counts did not arrive within " + std::to_string(core.host_limit_s()) + " s");
  std::atomic_thread_fence(std::memory_order_acquire);
  mailbox.last_wait_s = std::chrono::duration<double>(HostClock::now() - start).count();
  if (box->failed) {
    core.check_errors(op);
    throw InvalidArgument(std::string(op) + ": a rank passed invalid input; nothing was dispatched");
  }
  InternodeDispatchCounts out;
  out.num_recv_tokens = box->num_recv_tokens;
  out.num_forward_tokens = box->num_forward_tokens;
  out.num_parts = box->num_parts;
  out.num_recv_tokens_per_expert.assign(box->num_recv_tokens_per_expert,
                                        box->num_recv_tokens_per_expert + experts_per_rank);
  return out;
}

}  // namespace

kernels::internode::NotifyParams notify_params(BufferCore& core, const Regions& regions, bool exchange_counts,
                                               const InternodeDispatchCountsArgs& counts, OpKind op) {
  const Topology& t = core.topology();
  kernels::internode::NotifyParams p{};
  p.peers = {core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks, t.num_nvl_ranks};
  p.net = regions.net;
  p.nvl = regions.nvl;
  p.net_local = static_cast<char*>(core.local_internode());
  p.exchange_counts = exchange_counts;
  p.counts = counts;
  // A shrink-mode combine judges every peer (the handle's live set: shrink mode).
  p.ctx = core.wait_context(op, op == OpKind::kCombine && counts.handle.live != nullptr);
  p.mask = const_cast<int32_t*>(core.mask());
  p.shrink_timeout_ns = core.wait_context(op, true).timeout_ns;
  return p;
}

void launch_notify(BufferCore& core, const kernels::internode::NotifyParams& p, const char* op, cudaStream_t stream) {
  const NvshmemApi& api = *core.internode_nvshmem();
  nvshmem_check(api, api.internode_notify(&p, stream), op);
}

InternodeDispatchCounts dispatch_counts(BufferCore& core, State& state, const InternodeDispatchCountsArgs& a,
                                        cudaStream_t stream) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.config);
  const Regions regions = check_dispatch_counts(a, shape);
  const bool wait = !a.cached && a.num_worst_tokens == 0 && a.num_tokens_per_expert != nullptr;
  if (wait) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    ops::require(capture == cudaStreamCaptureStatusNone, op,
                 "a dispatch that learns its receive counts on the host cannot be captured in a CUDA graph: pass "
                 "num_worst_tokens > 0 (outputs of that many rows, padding marked -1)");
  }
  const int32_t sequence = state.mailbox.next_sequence();
  core.begin_dispatch_call();
  auto p = notify_params(core, regions, !a.cached, a, OpKind::kDispatch);
  p.mailbox = wait ? static_cast<kernels::internode::CountsMailbox*>(state.mailbox.device()) : nullptr;
  p.sequence = sequence;
  launch_notify(core, p, op, stream);
  if (!wait) return {};
  return wait_recv_counts(core, state.mailbox, op, sequence, a.num_experts / core.topology().num_ranks);
}

}  // namespace turnout::internode
