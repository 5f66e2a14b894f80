// A dispatch's counts step, and the one host wait of the normal path.
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "kernels/intranode/launch.hpp"
#include "ops/intranode/intranode.hpp"
#include "ops/require.hpp"
#include "turnout/error.hpp"

namespace turnout::intranode {
namespace {

// Every rank learns here whether some rank's input was bad: then every rank
// raises, and none launches the data step.
DispatchCounts wait_recv_counts(BufferCore& core, CountsMailbox& mailbox, const char* op, int32_t sequence,
                                int experts_per_rank) {
  const auto* box = static_cast<const kernels::RecvCountsMailbox*>(mailbox.host());
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
    // Recorded before the counts were posted (or an earlier error holds the record).
    core.check_errors(op);
    throw InvalidArgument(std::string(op) + ": a rank passed invalid input; nothing was dispatched");
  }
  core.set_counted_rows({box->max_recv_tokens, box->own_rows_begin, box->own_rows});
  DispatchCounts out;
  out.num_recv_tokens = box->num_recv_tokens;
  out.own_rows_begin = box->own_rows_begin;
  out.num_own_rows = box->own_rows;
  out.num_recv_tokens_per_expert.assign(box->num_recv_tokens_per_expert,
                                        box->num_recv_tokens_per_expert + experts_per_rank);
  return out;
}

}  // namespace

CountsMailbox::CountsMailbox() : host_(allocate_host_mapped(kernels::kMailboxBytes)) {
  std::memset(host_.get(), 0, kernels::kMailboxBytes);
  TURNOUT_CUDA_CHECK(cudaHostGetDevicePointer(&device_, host_.get(), 0));
}

DispatchCounts dispatch_counts(BufferCore& core, CountsMailbox& mailbox, const DispatchCountsArgs& a,
                               cudaStream_t stream) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const kernels::IntranodeRegion region = check_dispatch_counts(a, shape);
  const bool wait = a.num_worst_tokens == 0 && a.num_tokens_per_expert != nullptr;
  if (wait) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    ops::require(capture == cudaStreamCaptureStatusNone, op,
                 "a dispatch that learns its receive counts on the host cannot be captured in a CUDA graph: pass "
                 "num_worst_tokens > 0 (outputs of that many rows, padding marked -1)");
  }
  auto* device_box = wait ? static_cast<kernels::RecvCountsMailbox*>(mailbox.device()) : nullptr;
  const int32_t sequence = mailbox.next_sequence();
  core.begin_dispatch_call();
  core.set_counted_rows({});
  kernels::launch_intranode_notify(counts_params(core, a, region, device_box, sequence), stream);
  if (!wait) return {};
  return wait_recv_counts(core, mailbox, op, sequence, a.num_experts / core.topology().num_ranks);
}

kernels::NotifyParams counts_params(BufferCore& core, const DispatchCountsArgs& a,
                                    const kernels::IntranodeRegion& region, kernels::RecvCountsMailbox* mailbox,
                                    int32_t sequence) {
  const Topology& t = core.topology();
  return {{core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks},
          region,
          true,
          a,
          {},
          mailbox,
          sequence,
          core.wait_context(OpKind::kDispatch, true)};
}

}  // namespace turnout::intranode
