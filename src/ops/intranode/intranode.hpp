// Intranode normal mode behind the Buffer facade: dispatch (counts step, then
// data step) and combine inside one NVL domain. The argument checks are free
// functions (check.hpp); this is the state of the mode and its ops.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "kernels/intranode/launch.hpp"
#include "ops/buffer_core.hpp"
#include "ops/intranode/check.hpp"
#include "ops/op_graph.hpp"
#include "runtime/cuda_resources.hpp"
#include "turnout/intranode.hpp"

namespace turnout::intranode {

// The counts mailbox's sequence after `last`: 1, 2, ..., 2^32 - 1, then 1
// again. Never 0, the zeroed mailbox's value, so a wait cannot take a
// mailbox no call wrote for its call's; unsigned, so it wraps without
// overflow (about 25 days of dispatches at 2,000 a second).
constexpr uint32_t next_counts_sequence(uint32_t last) {
  return last == UINT32_MAX ? 1 : last + 1;
}

// Where the counts step leaves the receive sizes for the host: host memory
// the kernel writes through its device view, tagged with the call's sequence.
class CountsMailbox {
 public:
  CountsMailbox();
  void release() { host_.reset(); }

  const void* host() const { return host_.get(); }
  void* device() const { return device_; }
  // The kernel stores it and the host compares it as the int32 it was.
  int32_t next_sequence() {
    sequence_ = next_counts_sequence(sequence_);
    return static_cast<int32_t>(sequence_);
  }
  // Seconds the last host wait for receive counts took, until they arrived.
  double last_wait_s = 0;

 private:
  HostMemory host_;
  void* device_ = nullptr;
  uint32_t sequence_ = 0;
};

// An environment switch that every rank sets alike: on unless `name` is "0".
inline bool switched_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::string_view(value) != "0";
}

// What every op of the mode does first: a live buffer, no timeout, one NVL
// domain, a usable config. The call runs on the config's SMs, at most the
// budget, since every block must be resident at once (senders and receivers
// wait on each other, also across ranks that share a GPU). Input errors of
// earlier calls are raised only after the launches (see turnout/buffer.hpp).
BufferShape begin_op(BufferCore& core, const char* op, int num_sms, int send_tokens, int recv_tokens);

// The copies of rows [0, rows) of `from` into the same rows of `to`, all but
// rows [skip_begin, skip_begin + skip) (clamped to them): a rank's rows from
// itself, which the kernels move on their own. As steps of an op's graph,
// none empty: at most two.
struct RowCopies {
  std::array<GraphStep, 2> steps;
  int count = 0;
};
RowCopies rows_around(void* to, const void* from, int64_t rows, int64_t skip_begin, int64_t skip, int64_t row_bytes);
// The copies one by one (cudaMemcpyAsync), where no graph takes them.
void copy_one_by_one(const RowCopies& copies, cudaStream_t stream);

// Step 1 of a dispatch: exchange the counts; unless num_worst_tokens > 0,
// wait for them on the host (see turnout::Buffer::dispatch_counts).
DispatchCounts dispatch_counts(BufferCore& core, CountsMailbox& mailbox, const DispatchCountsArgs& args,
                               cudaStream_t stream);
// The counts step's parameters (mailbox: null where the host does not wait).
kernels::NotifyParams counts_params(BufferCore& core, const DispatchCountsArgs& args,
                                    const kernels::IntranodeRegion& region, kernels::RecvCountsMailbox* mailbox,
                                    int32_t sequence);
// Step 2: move the tokens.
// A landing dispatch enqueues its launch and copies through `graph`.
void dispatch(BufferCore& core, OpGraph& graph, const DispatchArgs& args, cudaStream_t stream);
// Both steps where the receive rows are known before the counts (see
// turnout::Buffer::dispatch_known_rows): one launch where this rank has its
// GPU to itself.
void dispatch_known_rows(BufferCore& core, CountsMailbox& mailbox, OpGraph& graph, const DispatchCountsArgs& counts,
                         const DispatchArgs& args, cudaStream_t stream);
// A staged combine enqueues its copies and launches through `graph`.
void combine(BufferCore& core, OpGraph& graph, const CombineArgs& args, cudaStream_t stream);

}  // namespace turnout::intranode
