#include "turnout/buffer.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/intranode/launch.hpp"
#include "kernels/launch.hpp"
#include "runtime/control_region.hpp"
#include "runtime/host_wait.hpp"
#include "runtime/sm_budget.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

constexpr double kDefaultTimeoutS = 100.0;
// The host gives the kernels' own timeout this much longer before it gives up
// on the GPU altogether.
constexpr double kHostGraceS = 2.0;
// Layout workspaces: the eager calls' one, then one per captured call.
constexpr size_t kLayoutPoolBytes = 4 << 20;

struct RankInfo {
  uint64_t host_id;
  uint64_t num_nvl_bytes;
  uint64_t num_rdma_bytes;
  RankGpu gpu;
};

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

}  // namespace

double default_timeout_s() {
  const char* env = std::getenv("TURNOUT_TIMEOUT_S");
  if (!env || !*env) return kDefaultTimeoutS;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  if (*end != '\0' || !std::isfinite(v) || v <= 0)
    throw InvalidArgument(std::string("TURNOUT_TIMEOUT_S must be a positive number of seconds, got '") + env + "'");
  return v;
}

Buffer::Buffer(Bootstrap& bootstrap, const BufferOptions& options)
    : options_(options), timeout_s_(options.timeout_s > 0 ? options.timeout_s : default_timeout_s()) {
  if (options.low_latency_mode)
    throw NotSupported("Buffer: low_latency_mode is not available in this version of turnout");
  if (options.num_rdma_bytes > 0)
    throw NotSupported("Buffer: num_rdma_bytes > 0 (internode / low-latency buffer) is not available in this version "
                       "of turnout; pass num_rdma_bytes=0");
  if (!std::isfinite(timeout_s_)) throw InvalidArgument("Buffer: timeout_s must be finite");
  TURNOUT_CUDA_CHECK(cudaGetDevice(&device_));

  const RankInfo mine{local_host_id(), options.num_nvl_bytes, options.num_rdma_bytes, local_rank_gpu(device_)};
  const auto gathered = bootstrap.all_gather(std::as_bytes(std::span(&mine, 1)));
  std::vector<RankInfo> all(bootstrap.size());
  std::memcpy(all.data(), gathered.data(), all.size() * sizeof(RankInfo));
  std::vector<uint64_t> host_ids;
  for (int r = 0; r < bootstrap.size(); ++r) {
    if (all[r].num_nvl_bytes != mine.num_nvl_bytes)
      throw InvalidArgument("Buffer: num_nvl_bytes differs between ranks: rank " + std::to_string(r) + " passed " +
                            std::to_string(all[r].num_nvl_bytes) + ", rank " + std::to_string(bootstrap.rank()) +
                            " passed " + std::to_string(mine.num_nvl_bytes));
    host_ids.push_back(all[r].host_id);
  }
  topology_ = make_topology(bootstrap.rank(), host_ids, options.nvl_domain_size);
  std::vector<RankGpu> domain;
  for (int nvl = 0; nvl < topology_.num_nvl_ranks; ++nvl) domain.push_back(all[topology_.nvl_peer_rank(nvl)].gpu);
  sm_budget_ = turnout::sm_budget(domain);
  ranks_on_gpu_ = turnout::ranks_on_gpu(domain, topology_.nvl_rank());

  if (options.comm_stream) {
    comm_stream_ = options.comm_stream;
  } else {
    owned_comm_stream_ = create_comm_stream();
    comm_stream_ = owned_comm_stream_.get();
  }
  sync_event_ = create_event();
  join_event_ = create_event();
  nvl_ = std::make_unique<PeerMemory>(bootstrap, topology_, kControlBytes + align16(options.num_nvl_bytes));
  void* user[kMaxNvlRanks] = {};
  for (int i = 0; i < topology_.num_nvl_ranks; ++i) user[i] = static_cast<char*>(nvl_->peer(i)) + kControlBytes;
  peer_user_table_ = allocate_device(sizeof(user));
  layout_pool_ = allocate_device(kLayoutPoolBytes);
  TURNOUT_CUDA_CHECK(cudaMemset(layout_pool_.get(), 0, kLayoutPoolBytes));
  layout_pool_used_ = kLayoutWorkspaceBytes;
  recv_counts_ = allocate_host_mapped(kernels::kMailboxBytes);
  std::memset(recv_counts_.get(), 0, kernels::kMailboxBytes);
  TURNOUT_CUDA_CHECK(cudaHostGetDevicePointer(&recv_counts_device_, recv_counts_.get(), 0));
  TURNOUT_CUDA_CHECK(cudaMemcpy(peer_user_table_.get(), user, sizeof(user), cudaMemcpyHostToDevice));
}

Buffer::~Buffer() {
  try {
    destroy();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turnout: rank %d: error while destroying a Buffer: %s\n", topology_.rank, e.what());
  }
}

void Buffer::destroy() {
  if (!nvl_) return;
  // Peers may still be reading or writing our memory: meet them first, unless
  // a peer already failed to arrive (then a barrier would only wait again).
  cudaError_t st = cudaDeviceSynchronize();
  if (st == cudaSuccess && !errors_.timed_out() && topology_.num_nvl_ranks > 1) {
    try {
      barrier(comm_stream_);
      synchronize(comm_stream_, "Buffer.destroy");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "turnout: rank %d: peers did not meet at destroy, freeing anyway: %s\n", topology_.rank,
                   e.what());
    }
  }
  peer_user_table_.reset();
  layout_pool_.reset();
  recv_counts_.reset();
  nvl_.reset();
  sync_event_.reset();
  join_event_.reset();
  owned_comm_stream_.reset();
  comm_stream_ = nullptr;
  if (st != cudaSuccess) detail::throw_cuda_error(st, "cudaDeviceSynchronize()", __FILE__, __LINE__);
}

void Buffer::require_alive(const char* op) const {
  if (!nvl_) throw Error(std::string(op) + ": the buffer was destroyed");
}

void* Buffer::local_nvl_buffer() const {
  require_alive("local_nvl_buffer");
  return static_cast<char*>(nvl_->local()) + kControlBytes;
}

void* const* Buffer::peer_nvl_table() const {
  require_alive("peer_nvl_table");
  return static_cast<void* const*>(peer_user_table_.get());
}

void Buffer::check_errors(const char* op) { errors_.check(op, topology_.nvl_peer_rank(0), last_dispatch_call_); }

kernels::WaitContext Buffer::wait_context(OpKind op) const {
  return {errors_.device(op, calls_), static_cast<uint64_t>(timeout_s_ * 1e9), topology_.rank,
          topology_.nvl_peer_rank(0)};
}

void Buffer::get_dispatch_layout(const LayoutArgs& args, cudaStream_t stream) {
  const char* op = "get_dispatch_layout";
  require_alive(op);
  // A local op: an error left by an earlier call is raised before the launch.
  check_errors(op);
  // A captured call gets a workspace of its own, so that its replays cannot
  // overlap an eager call (or another graph) on the same counters.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  void* workspace = layout_pool_.get();
  if (capture != cudaStreamCaptureStatusNone) {
    const int counters = args.num_experts + topology_.num_ranks + topology_.num_rdma_ranks();
    const size_t bytes = (layout_workspace_bytes(counters) + 127) / 128 * 128;
    if (counters > kMaxLayoutCounters || layout_pool_used_ + bytes > kLayoutPoolBytes)
      throw NotSupported(std::string(op) + ": this buffer has no layout workspace left for another captured call (" +
                         std::to_string(kLayoutPoolBytes - kLayoutWorkspaceBytes) + " bytes, " +
                         std::to_string(bytes) + " per captured call)");
    workspace = static_cast<char*>(layout_pool_.get()) + layout_pool_used_;
    layout_pool_used_ += bytes;
  }
  turnout::get_dispatch_layout(args, topology_, errors_.device(OpKind::kLayout, ++calls_), workspace, stream);
}

void Buffer::barrier(cudaStream_t stream) {
  require_alive("barrier");
  check_errors("barrier");
  ++calls_;
  const kernels::WaitContext ctx = wait_context(OpKind::kBarrier);
  kernels::launch_barrier(nvl_->device_table(), topology_.nvl_rank(), topology_.num_nvl_ranks, ctx, stream);
}

namespace {

void check_copy(const char* op, const void* local, size_t bytes, size_t offset, int nvl_ranks, size_t capacity,
                int num_sms) {
  const std::string fn = op;
  if (reinterpret_cast<uintptr_t>(local) % 16 || bytes % 16 || offset % 16)
    throw InvalidArgument(fn + ": pointer, bytes and offset must be multiples of 16");
  if (num_sms < 1 || num_sms > 1024)
    throw InvalidArgument(fn + ": num_sms must be in [1, 1024], got " + std::to_string(num_sms));
  if (offset + bytes * nvl_ranks > capacity)
    throw InvalidArgument(fn + ": " + std::to_string(offset + bytes * nvl_ranks) +
                          " bytes needed, the NVL buffer holds " + std::to_string(capacity));
}

}  // namespace

void Buffer::store_to_peers(const void* src, size_t bytes, size_t dst_offset, bool include_self, int num_sms,
                            cudaStream_t stream) {
  require_alive("store_to_peers");
  check_copy("store_to_peers", src, bytes, dst_offset, topology_.num_nvl_ranks, options_.num_nvl_bytes, num_sms);
  kernels::launch_store_to_peers(peer_nvl_table(), topology_.nvl_rank(), topology_.num_nvl_ranks, src, bytes,
                                 dst_offset, include_self, num_sms, stream);
}

void Buffer::load_from_peers(void* dst, size_t bytes, size_t src_offset, int num_sms, cudaStream_t stream) {
  require_alive("load_from_peers");
  check_copy("load_from_peers", dst, bytes, src_offset, 1, options_.num_nvl_bytes, num_sms);
  kernels::launch_load_from_peers(peer_nvl_table(), topology_.num_nvl_ranks, dst, bytes, src_offset, num_sms, stream);
}

void Buffer::join(cudaStream_t waiter, cudaStream_t waited) {
  require_alive("join");
  if (waiter == waited) return;
  TURNOUT_CUDA_CHECK(cudaEventRecord(join_event_.get(), waited));
  TURNOUT_CUDA_CHECK(cudaStreamWaitEvent(waiter, join_event_.get(), 0));
}

void Buffer::synchronize(cudaStream_t stream, const char* op) {
  require_alive(op);
  TURNOUT_CUDA_CHECK(cudaEventRecord(sync_event_.get(), stream));
  const auto deadline = HostClock::now() + std::chrono::duration_cast<HostClock::duration>(
                                               std::chrono::duration<double>(timeout_s_ + kHostGraceS));
  const auto done = [&] {
    const cudaError_t st = cudaEventQuery(sync_event_.get());
    if (st != cudaSuccess && st != cudaErrorNotReady)
      detail::throw_cuda_error(st, "cudaEventQuery", __FILE__, __LINE__);
    return st == cudaSuccess;
  };
  // A timeout ends the wait at once (the kernels drain by themselves); an
  // input error is raised once the work is done, so clearing it cannot race
  // with a kernel that is still recording. Most waits are microseconds: poll
  // back to back briefly, then stop burning a core.
  const auto timed_out = [&] {
    if (errors_.timed_out()) check_errors(op);
  };
  if (!host_wait(op, deadline, {std::chrono::microseconds(200), std::chrono::microseconds(50)}, done, timed_out))
    throw TimeoutError(std::string(op) + ": rank " + std::to_string(topology_.rank) +
                       ": the GPU did not finish within " + std::to_string(timeout_s_ + kHostGraceS) + " s");
  check_errors(op);
}

bool is_sm90_compiled() {
  const std::string archs = TURNOUT_CUDA_ARCHS;
  size_t pos = 0;
  while (pos <= archs.size()) {
    const size_t end = archs.find(',', pos);
    const std::string arch = archs.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    if (arch.rfind("90", 0) == 0) return true;
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return false;
}

}  // namespace turnout
