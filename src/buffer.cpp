// The Buffer facade: each op goes to its mode (src/ops/<mode>/), over the
// state every op shares (src/ops/buffer_core.hpp).
#include "turnout/buffer.hpp"

#include <cstdio>
#include <exception>
#include <string>

#include "ops/buffer_core.hpp"
#include "ops/internode/internode.hpp"
#include "ops/intranode/intranode.hpp"
#include "ops/layout/layout.hpp"
#include "ops/low_latency/low_latency.hpp"
#include "ops/peer_copy.hpp"
#include "turnout/error.hpp"

namespace turnout {

struct Buffer::State {
  State(Bootstrap& bootstrap, const BufferOptions& options) : core(bootstrap, options) {}

  BufferCore core;
  layout::Workspaces layout;
  intranode::CountsMailbox intranode;
  OpGraph dispatch_graph;
  OpGraph landing_graph;
  OpGraph combine_graph;
  internode::State internode;
};

namespace {

// What the core does not check itself, before it is built.
const BufferOptions& checked(const BufferOptions& options) {
  if (options.num_qps_per_rank < 1)
    throw InvalidArgument("Buffer: num_qps_per_rank must be >= 1, got " + std::to_string(options.num_qps_per_rank));
  return options;
}

}  // namespace

Buffer::Buffer(Bootstrap& bootstrap, const BufferOptions& options)
    : state_(std::make_unique<State>(bootstrap, checked(options))) {}

Buffer::~Buffer() {
  try {
    destroy();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turnout: rank %d: error while destroying a Buffer: %s\n", topology().rank, e.what());
  }
}

void Buffer::destroy() {
  if (state_->core.destroyed()) return;
  // The modes' memory goes once the core has met the peers (until then they
  // may still use it), also when that meeting failed.
  struct ReleaseModes {
    State& state;
    ~ReleaseModes() {
      state.layout.release();
      state.intranode.release();
      state.dispatch_graph.release();
      state.landing_graph.release();
      state.combine_graph.release();
      state.internode.release();
    }
  } release{*state_};
  state_->core.destroy();
}

bool Buffer::destroyed() const {
  return state_->core.destroyed();
}
const Topology& Buffer::topology() const {
  return state_->core.topology();
}
int Buffer::device() const {
  return state_->core.device();
}
double Buffer::timeout_s() const {
  return state_->core.timeout_s();
}
int Buffer::sm_budget() const {
  return state_->core.sm_budget();
}
const char* Buffer::peer_memory_kind() const {
  return state_->core.nvl().kind_name();
}
int Buffer::ranks_on_gpu() const {
  return state_->core.ranks_on_gpu();
}
bool Buffer::one_launch() const {
  return state_->core.one_launch();
}
size_t Buffer::num_nvl_bytes() const {
  return state_->core.options().num_nvl_bytes;
}
cudaStream_t Buffer::comm_stream() const {
  return state_->core.comm_stream();
}
void* Buffer::local_nvl_buffer() const {
  return state_->core.local_nvl_buffer();
}
void* const* Buffer::peer_nvl_table() const {
  return state_->core.peer_nvl_table();
}
double Buffer::last_host_wait_s() const {
  return topology().single_nvl_domain() ? state_->intranode.last_wait_s : state_->internode.mailbox.last_wait_s;
}

void Buffer::get_dispatch_layout(const LayoutArgs& args, cudaStream_t stream) {
  layout::get_dispatch_layout(state_->core, state_->layout, args, stream);
}

DispatchCounts Buffer::dispatch_counts(const DispatchCountsArgs& args, cudaStream_t stream) {
  return intranode::dispatch_counts(state_->core, state_->intranode, args, stream);
}

void Buffer::dispatch(const DispatchArgs& args, cudaStream_t stream) {
  intranode::dispatch(state_->core, state_->landing_graph, args, stream);
}

void Buffer::dispatch_known_rows(const DispatchCountsArgs& counts, const DispatchArgs& args, cudaStream_t stream) {
  intranode::dispatch_known_rows(state_->core, state_->intranode, state_->dispatch_graph, counts, args, stream);
}

void Buffer::combine(const CombineArgs& args, cudaStream_t stream) {
  intranode::combine(state_->core, state_->combine_graph, args, stream);
}

InternodeDispatchCounts Buffer::internode_dispatch_counts(const InternodeDispatchCountsArgs& args,
                                                          cudaStream_t stream) {
  return internode::dispatch_counts(state_->core, state_->internode, args, stream);
}

void Buffer::internode_dispatch(const InternodeDispatchArgs& args, cudaStream_t stream) {
  internode::dispatch(state_->core, args, stream);
}

void Buffer::internode_combine(const InternodeCombineArgs& args, cudaStream_t stream) {
  internode::combine(state_->core, args, stream);
}

size_t Buffer::num_internode_bytes() const {
  return state_->core.internode_bytes();
}

void Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& args, LowLatencyPhase phase, cudaStream_t stream) {
  low_latency::dispatch(state_->core, args, phase, stream);
}

void Buffer::low_latency_combine(const LowLatencyCombineArgs& args, LowLatencyPhase phase, cudaStream_t stream) {
  low_latency::combine(state_->core, args, phase, stream);
}

void Buffer::clean_low_latency_buffer(cudaStream_t stream, uint64_t first_call) {
  low_latency::clean(state_->core, stream, first_call);
}

std::array<uint64_t, 4> Buffer::low_latency_call_numbers() {
  return low_latency::call_numbers(state_->core);
}

void Buffer::update_mask(int rank, bool masked, cudaStream_t stream) {
  state_->core.update_mask(rank, masked, stream);
}

void Buffer::query_mask(int32_t* out, cudaStream_t stream) {
  state_->core.query_mask(out, stream);
}

void Buffer::clean_mask(cudaStream_t stream) {
  state_->core.clean_mask(stream);
}

bool Buffer::shrink_enabled() const {
  return state_->core.shrink_enabled();
}

double Buffer::shrink_timeout_s() const {
  return state_->core.shrink_timeout_s();
}

size_t Buffer::num_low_latency_bytes() const {
  return state_->core.low_latency_bytes();
}

void Buffer::barrier(cudaStream_t stream) {
  state_->core.barrier(stream);
}

void Buffer::store_to_peers(const void* src, size_t bytes, size_t dst_offset, bool include_self, int num_sms,
                            cudaStream_t stream, bool bulk_copies, int warps_per_block, int words_in_flight) {
  peer_copy::store_to_peers(state_->core, src, bytes, dst_offset, include_self, num_sms, warps_per_block,
                            words_in_flight, bulk_copies, stream);
}

void Buffer::load_from_peers(void* dst, size_t bytes, size_t src_offset, int num_sms, cudaStream_t stream,
                             bool include_self, int warps_per_block, int words_in_flight) {
  peer_copy::load_from_peers(state_->core, dst, bytes, src_offset, include_self, num_sms, warps_per_block,
                             words_in_flight, stream);
}

void Buffer::join(cudaStream_t waiter, cudaStream_t waited) {
  state_->core.join(waiter, waited);
}

bool Buffer::follow(cudaStream_t waiter, cudaStream_t waited) {
  return state_->core.follow(waiter, waited);
}

void Buffer::check_errors(const char* op) {
  state_->core.check_errors(op);
}

void Buffer::synchronize(cudaStream_t stream, const char* op) {
  state_->core.synchronize(stream, op);
}

}  // namespace turnout
