#include "ops/buffer_core.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/internode/launch.hpp"
#include "kernels/launch.hpp"
#include "kernels/low_latency/group_barrier.hpp"
#include "kernels/low_latency/launch.hpp"
#include "runtime/align.hpp"
#include "runtime/control_region.hpp"
#include "runtime/sm_budget.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

constexpr double kDefaultTimeoutS = 100.0;
// Long enough that a rank busy between calls (a large GEMM, a graph capture)
// is not taken for dead; short enough that a serving stack notices in time.
constexpr double kDefaultShrinkTimeoutS = 5.0;
// A host wait gives the kernels' own timeout this much longer before it gives
// up on the GPU altogether.
constexpr double kHostGraceS = 2.0;

struct RankInfo {
  uint64_t host_id;
  int64_t nvl_domain_size;  // declared (0: the host)
  uint64_t num_nvl_bytes;
  uint64_t num_rdma_bytes;
  RankGpu gpu;
  // Options every rank must pass alike: the first decides who takes part in
  // NVSHMEM's collective set-up, the second how it is torn down (and the
  // barriers it meets in).
  uint8_t allow_nvlink_for_low_latency_mode;
  uint8_t enable_shrink;
};

}  // namespace

namespace {

double seconds_from_env(const char* name, double fallback) {
  const char* env = std::getenv(name);
  if (!env || !*env) return fallback;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  if (*end != '\0' || !std::isfinite(v) || v <= 0)
    throw InvalidArgument(std::string(name) + " must be a positive number of seconds, got '" + env + "'");
  return v;
}

}  // namespace

double default_timeout_s() {
  return seconds_from_env("TURNOUT_TIMEOUT_S", kDefaultTimeoutS);
}

double default_shrink_timeout_s() {
  return seconds_from_env("TURNOUT_SHRINK_TIMEOUT_S", kDefaultShrinkTimeoutS);
}

int default_nvl_domain_size() {
  const char* env = std::getenv("TURNOUT_NVL_DOMAIN_SIZE");
  if (!env || !*env) return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end != '\0' || v < 1 || v > (1 << 20))
    throw InvalidArgument(std::string("TURNOUT_NVL_DOMAIN_SIZE must be a positive number of ranks, got '") + env + "'");
  return static_cast<int>(v);
}

BufferCore::BufferCore(Bootstrap& bootstrap, const BufferOptions& options)
    : options_(options),
      timeout_s_(options.timeout_s > 0 ? options.timeout_s : default_timeout_s()),
      shrink_timeout_s_(options.shrink_timeout_s > 0 ? options.shrink_timeout_s : default_shrink_timeout_s()) {
  if (!std::isfinite(timeout_s_)) throw InvalidArgument("Buffer: timeout_s must be finite");
  if (!std::isfinite(shrink_timeout_s_)) throw InvalidArgument("Buffer: shrink_timeout_s must be finite");
  TURNOUT_CUDA_CHECK(cudaGetDevice(&device_));

  const int declared = options.nvl_domain_size > 0 ? options.nvl_domain_size : default_nvl_domain_size();
  const RankInfo mine{local_host_id(),
                      declared,
                      options.num_nvl_bytes,
                      options.num_rdma_bytes,
                      local_rank_gpu(device_),
                      static_cast<uint8_t>(options.allow_nvlink_for_low_latency_mode),
                      static_cast<uint8_t>(options.enable_shrink)};
  const auto gathered = bootstrap.all_gather(std::as_bytes(std::span(&mine, 1)));
  std::vector<RankInfo> all(bootstrap.size());
  std::memcpy(all.data(), gathered.data(), all.size() * sizeof(RankInfo));
  std::vector<uint64_t> host_ids;
  for (int r = 0; r < bootstrap.size(); ++r) {
    if (all[r].num_nvl_bytes != mine.num_nvl_bytes)
      throw InvalidArgument("Buffer: num_nvl_bytes differs between ranks: rank " + std::to_string(r) + " passed " +
                            std::to_string(all[r].num_nvl_bytes) + ", rank " + std::to_string(bootstrap.rank()) +
                            " passed " + std::to_string(mine.num_nvl_bytes));
    if (all[r].num_rdma_bytes != mine.num_rdma_bytes)
      throw InvalidArgument("Buffer: num_rdma_bytes differs between ranks: rank " + std::to_string(r) + " passed " +
                            std::to_string(all[r].num_rdma_bytes) + ", rank " + std::to_string(bootstrap.rank()) +
                            " passed " + std::to_string(mine.num_rdma_bytes));
    if (all[r].nvl_domain_size != mine.nvl_domain_size)
      throw InvalidArgument(
          "Buffer: the declared NVL domain size (nvl_domain_size or TURNOUT_NVL_DOMAIN_SIZE) differs "
          "between ranks: rank " +
          std::to_string(r) + " declared " + std::to_string(all[r].nvl_domain_size) + ", rank " +
          std::to_string(bootstrap.rank()) + " declared " + std::to_string(mine.nvl_domain_size) + " (0: the host)");
    const auto same_flag = [&](uint8_t theirs, uint8_t ours, const char* name) {
      if (theirs != ours)
        throw InvalidArgument(std::string("Buffer: ") + name + " differs between ranks: rank " + std::to_string(r) +
                              " passed " + (theirs ? "True" : "False") + ", rank " + std::to_string(bootstrap.rank()) +
                              " passed " + (ours ? "True" : "False"));
    };
    same_flag(all[r].allow_nvlink_for_low_latency_mode, mine.allow_nvlink_for_low_latency_mode,
              "allow_nvlink_for_low_latency_mode");
    same_flag(all[r].enable_shrink, mine.enable_shrink, "enable_shrink");
    host_ids.push_back(all[r].host_id);
  }
  topology_ = make_topology(bootstrap.rank(), host_ids, declared);
  // Low-latency mode reaches a peer out of NVLink reach through NVSHMEM.
  const bool over_nvshmem = options.low_latency_mode && topology_.num_ranks > 1 &&
                            (!topology_.single_nvl_domain() || !options.allow_nvlink_for_low_latency_mode);
  if (over_nvshmem && topology_.num_ranks > kernels::low_latency::kMaxGroupRanks)
    throw NotSupported("Buffer: low_latency_mode across NVL domains takes at most " +
                       std::to_string(kernels::low_latency::kMaxGroupRanks) +
                       " ranks in this version of turnout; this group has " + std::to_string(topology_.num_ranks));
  if (options.low_latency_mode && options.num_rdma_bytes == 0)
    throw InvalidArgument(
        "Buffer: low_latency_mode needs num_rdma_bytes > 0 (see get_low_latency_rdma_size_hint), got 0");
  // Internode normal mode's network region; within one NVL domain
  // num_rdma_bytes is unused, as in DeepEP.
  const bool internode = !options.low_latency_mode && options.num_rdma_bytes > 0 && !topology_.single_nvl_domain();
  if (internode && topology_.num_rdma_ranks() > kernels::internode::kMaxDomains)
    throw NotSupported("Buffer: internode mode takes at most " + std::to_string(kernels::internode::kMaxDomains) +
                       " NVL domains; this group has " + std::to_string(topology_.num_rdma_ranks()));
  if (internode && topology_.num_rdma_ranks() + topology_.num_nvl_ranks > kernels::internode::kMaxBlockWarps)
    throw NotSupported("Buffer: internode mode takes at most " + std::to_string(kernels::internode::kMaxBlockWarps) +
                       " NVL domains and ranks per domain together (a warp each in one block); this group has " +
                       std::to_string(topology_.num_rdma_ranks()) + " domains of " +
                       std::to_string(topology_.num_nvl_ranks));
  // The SMs of a GPU are shared by every rank on it, whatever its declared
  // domain.
  std::vector<RankGpu> host;
  int host_index = 0;
  for (int r = 0; r < bootstrap.size(); ++r) {
    if (all[r].host_id != mine.host_id) continue;
    if (r == bootstrap.rank()) host_index = static_cast<int>(host.size());
    host.push_back(all[r].gpu);
  }
  sm_budget_ = turnout::sm_budget(host);
  ranks_on_gpu_ = turnout::ranks_on_gpu(host, host_index);
  const char* one_launch = std::getenv("TURNOUT_ONE_LAUNCH");
  one_launch_ = ranks_on_gpu_ == 1 || (one_launch && std::string_view(one_launch) == "1");
  first_peer_rank_ = over_nvshmem ? 0 : topology_.nvl_peer_rank(0);

  if (options.comm_stream) {
    comm_stream_ = options.comm_stream;
  } else {
    owned_comm_stream_ = create_comm_stream();
    comm_stream_ = owned_comm_stream_.get();
  }
  sync_event_ = create_event();
  join_event_ = create_event();
  if (options.enable_shrink) {
    const size_t bytes = sizeof(int32_t) * topology_.num_ranks;
    mask_ = allocate_device(bytes);
    TURNOUT_CUDA_CHECK(cudaMemset(mask_.get(), 0, bytes));
  }
  // One allocation per rank: control, the normal modes' bytes, then the
  // low-latency bytes (only in low-latency mode: on one host nothing else
  // uses num_rdma_bytes).
  const size_t user_bytes = align_up(static_cast<int64_t>(options.num_nvl_bytes), 4096);
  low_latency_bytes_ =
      options.low_latency_mode ? static_cast<size_t>(align_up(static_cast<int64_t>(options.num_rdma_bytes), 4096)) : 0;
  const size_t shared_low_latency = over_nvshmem ? 0 : low_latency_bytes_;
  nvl_ =
      std::make_unique<PeerMemory>(bootstrap, topology_, kControlBytes + user_bytes + shared_low_latency, timeout_s_);
  void* user[kMaxNvlRanks] = {};
  void* low_latency[kMaxNvlRanks] = {};
  for (int i = 0; i < topology_.num_nvl_ranks; ++i) {
    user[i] = static_cast<char*>(nvl_->peer(i)) + kControlBytes;
    if (shared_low_latency) low_latency[i] = static_cast<char*>(user[i]) + user_bytes;
  }
  peer_user_table_ = allocate_device(sizeof(user));
  TURNOUT_CUDA_CHECK(cudaMemcpy(peer_user_table_.get(), user, sizeof(user), cudaMemcpyHostToDevice));
  local_low_latency_ = low_latency[topology_.nvl_rank()];
  if (over_nvshmem)
    open_low_latency_over_nvshmem(bootstrap);
  else if (low_latency_bytes_)
    set_low_latency_table(std::vector<void*>(low_latency, low_latency + topology_.num_nvl_ranks));
  if (internode) {
    internode_bytes_ = static_cast<size_t>(align_up(static_cast<int64_t>(options.num_rdma_bytes), 4096));
    open_internode_over_nvshmem(bootstrap);
  }
}

void BufferCore::open_nvshmem(Bootstrap& bootstrap, size_t symmetric_bytes) {
  NvshmemSettings settings;
  settings.num_qps_per_rank = options_.num_qps_per_rank;
  settings.allow_mnnvl = options_.allow_mnnvl;
  settings.symmetric_bytes = symmetric_bytes;
  nvshmem_ = std::make_unique<NvshmemWindow>(bootstrap, settings);
}

void BufferCore::open_internode_over_nvshmem(Bootstrap& bootstrap) {
  open_nvshmem(bootstrap, internode_bytes_);
  const NvshmemApi& api = nvshmem_api();
  if (api.internode_notify_params_bytes != sizeof(kernels::internode::NotifyParams) ||
      api.internode_dispatch_params_bytes != sizeof(kernels::internode::DispatchParams) ||
      api.internode_combine_params_bytes != sizeof(kernels::internode::CombineParams))
    throw NotSupported("Buffer: " + nvshmem_library_path() +
                       " was built from other sources than this turnout (its internode structs differ in size); "
                       "reinstall turnout");
  internode_nvshmem_ = &api;
  internode_symmetric_ = nvshmem_->alloc(internode_bytes_);
  // Zeroed on every rank before any rank's first call can write to it: the
  // counters of kernels/internode/region.hpp start at 0.
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(internode_symmetric_.get(), 0, internode_bytes_, comm_stream_));
  nvshmem_->barrier(comm_stream_);
  synchronize(comm_stream_, "Buffer");
}

void BufferCore::set_low_latency_table(const std::vector<void*>& regions) {
  low_latency_regions_ = regions;
  low_latency_table_ = allocate_device(regions.size() * sizeof(void*));
  TURNOUT_CUDA_CHECK(
      cudaMemcpy(low_latency_table_.get(), regions.data(), regions.size() * sizeof(void*), cudaMemcpyHostToDevice));
}

void BufferCore::open_low_latency_over_nvshmem(Bootstrap& bootstrap) {
  open_nvshmem(bootstrap, low_latency_bytes_);
  const NvshmemApi& api = nvshmem_api();
  if (api.low_latency_dispatch_args_bytes != sizeof(LowLatencyDispatchArgs) ||
      api.low_latency_combine_args_bytes != sizeof(LowLatencyCombineArgs) ||
      api.low_latency_region_bytes != sizeof(kernels::low_latency::Region) ||
      api.low_latency_group_bytes != sizeof(kernels::low_latency::Group))
    throw NotSupported("Buffer: " + nvshmem_library_path() +
                       " was built from other sources than this turnout (its low-latency structs differ in size); "
                       "reinstall turnout");
  if (api.low_latency_barrier_args_bytes != sizeof(kernels::low_latency::BarrierArgs))
    throw NotSupported("Buffer: " + nvshmem_library_path() +
                       " was built from other sources than this turnout (its barrier's arguments differ in size); "
                       "reinstall turnout");
  low_latency_nvshmem_ = &api;
  // The group barrier's state follows the region, out of clean's reach.
  const size_t symmetric_bytes = low_latency_bytes_ + kernels::low_latency::kBarrierAreaBytes;
  low_latency_symmetric_ = nvshmem_->alloc(symmetric_bytes);
  local_low_latency_ = low_latency_symmetric_.get();
  // Zeroed on every rank before any rank's first call can write to it.
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(local_low_latency_, 0, symmetric_bytes, comm_stream_));
  nvshmem_->barrier(comm_stream_);
  synchronize(comm_stream_, "Buffer");
  const int domain = topology_.rdma_rank();
  std::vector<void*> regions(topology_.num_ranks, nullptr);
  for (int r = 0; r < topology_.num_ranks; ++r) {
    if (r == topology_.rank)
      regions[r] = local_low_latency_;
    else if (options_.allow_nvlink_for_low_latency_mode && r / topology_.num_nvl_ranks == domain)
      regions[r] = nvshmem_->peer_ptr(local_low_latency_, r);
  }
  set_low_latency_table(regions);
}

void BufferCore::destroy() {
  if (!nvl_) return;
  // Peers may still be reading or writing our memory: meet them first, unless
  // a peer already failed to arrive (then a barrier would only wait again),
  // or in shrink mode, where a survivor must tear down without its dead peers
  // (their mappings of our memory keep it alive until they free theirs).
  cudaError_t st = cudaDeviceSynchronize();
  if (st == cudaSuccess && !errors_.timed_out() && !options_.enable_shrink && topology_.num_nvl_ranks > 1 &&
      !nvshmem_) {
    try {
      barrier(comm_stream_);
      synchronize(comm_stream_, "Buffer.destroy");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "turnout: rank %d: peers did not meet at destroy, freeing anyway: %s\n", topology_.rank,
                   e.what());
    }
  }
  // Shrink mode: NVSHMEM's collective free and finalize would wait forever
  // for a dead peer. Where any rank has a peer masked, every rank that meets
  // at the barrier below leaves NVSHMEM as it is instead (its symmetric heap
  // stays allocated until the process exits: the price of losing a rank).
  if (nvshmem_ && options_.enable_shrink && must_leave_nvshmem_alone(st)) {
    std::fprintf(stderr,
                 "turnout: rank %d: a peer is lost (masked); NVSHMEM is left initialized and its symmetric memory "
                 "allocated until this process exits\n",
                 topology_.rank);
    low_latency_symmetric_.abandon();
    internode_symmetric_.abandon();
    nvshmem_->abandon();
  }
  peer_user_table_.reset();
  mask_.reset();
  low_latency_table_.reset();
  local_low_latency_ = nullptr;
  low_latency_nvshmem_ = nullptr;
  internode_nvshmem_ = nullptr;
  // Collective, in this order, on every rank alike (whatever its own calls
  // saw): the symmetric memory, whose free meets every rank first (each has
  // synchronized its device above, so no kernel still touches it), then
  // NVSHMEM itself. That meeting also stands for the NVL barrier (internode
  // kernels write peers' NVL buffers): no rank frees its peer allocation
  // before every rank's kernels are done. Nothing collective where NVSHMEM
  // was left alone above.
  low_latency_symmetric_.reset();
  internode_symmetric_.reset();
  nvshmem_.reset();
  nvl_.reset();
  sync_event_.reset();
  join_event_.reset();
  owned_comm_stream_.reset();
  comm_stream_ = nullptr;
  if (st != cudaSuccess) detail::throw_cuda_error(st, "cudaDeviceSynchronize()", __FILE__, __LINE__);
}

bool BufferCore::must_leave_nvshmem_alone(cudaError_t device_status) {
  if (device_status != cudaSuccess || errors_.timed_out()) return true;
  if (low_latency_nvshmem_ == nullptr) {
    // Internode mode (shrink across domains) has no group
    // barrier to vote with: the verdict is this rank's own mask, which the
    // callers keep alike on every rank (a rank masked before the calls masks
    // itself too; the survivors' dispatch masks a rank that stopped calling,
    // which must mask itself if it is still there to destroy its buffer).
    std::vector<int32_t> mask(static_cast<size_t>(topology_.num_ranks), 1);
    if (cudaMemcpy(mask.data(), mask_.get(), mask.size() * sizeof(int32_t), cudaMemcpyDeviceToHost) != cudaSuccess)
      return true;
    for (int32_t m : mask)
      if (m != 0) return true;
    return false;
  }
  try {
    const DeviceMemory verdict = allocate_device(sizeof(int32_t));
    kernels::low_latency::BarrierArgs args;
    args.area = static_cast<int64_t>(low_latency_bytes_);
    args.leave_verdict = static_cast<int32_t*>(verdict.get());
    begin_call();
    launch_group_barrier(args, wait_context(OpKind::kBarrier, true), comm_stream_);
    synchronize(comm_stream_, "Buffer.destroy");
    int32_t alone = 1;
    TURNOUT_CUDA_CHECK(cudaMemcpy(&alone, verdict.get(), sizeof alone, cudaMemcpyDeviceToHost));
    return alone != 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turnout: rank %d: the peers' vote at destroy failed: %s\n", topology_.rank, e.what());
    return true;
  }
}

void BufferCore::launch_group_barrier(const kernels::low_latency::BarrierArgs& args, const kernels::WaitContext& wait,
                                      cudaStream_t stream) {
  kernels::low_latency::Group group;
  group.regions = low_latency_table();
  group.rank = topology_.rank;
  group.num_ranks = topology_.num_ranks;
  group.wait = wait;
  group.receive_wait = wait;
  nvshmem_check(*low_latency_nvshmem_, low_latency_nvshmem_->low_latency_barrier(&args, &group, stream), "barrier");
}

void BufferCore::require_alive(const char* op) const {
  if (!nvl_) throw Error(std::string(op) + ": the buffer was destroyed");
}

void* BufferCore::local_nvl_buffer() const {
  require_alive("local_nvl_buffer");
  return static_cast<char*>(nvl_->local()) + kControlBytes;
}

void* const* BufferCore::peer_nvl_table() const {
  require_alive("peer_nvl_table");
  return static_cast<void* const*>(peer_user_table_.get());
}

kernels::WaitContext BufferCore::wait_context(OpKind op, bool shrinkable, int patience) const {
  if (shrinkable && options_.enable_shrink)
    return {errors_.device(op, calls_), static_cast<uint64_t>(shrink_timeout_s_ * patience * 1e9), topology_.rank,
            first_peer_rank_, static_cast<int32_t*>(mask_.get())};
  return {errors_.device(op, calls_), static_cast<uint64_t>(timeout_s_ * patience * 1e9), topology_.rank,
          first_peer_rank_, nullptr};
}

double BufferCore::host_limit_s() const {
  // A shrink-mode call may wait out two shrink timeouts (a combine behind a dead source's weights), an
  // internode dispatch three (a dead rank, then the view of one that came late, twice as patient); without
  // shrink mode, a low-latency combine two timeouts (its receive's patience).
  const double kernels_limit = options_.enable_shrink      ? std::max(timeout_s_, 3 * shrink_timeout_s_)
                               : options_.low_latency_mode ? 2 * timeout_s_
                                                           : timeout_s_;
  return kernels_limit + kHostGraceS;
}

void BufferCore::update_mask(int rank, bool masked, cudaStream_t stream) {
  require_shrink("low_latency_update_mask_buffer");
  if (rank < 0 || rank >= topology_.num_ranks)
    throw InvalidArgument("low_latency_update_mask_buffer: rank_to_mask must be in [0, " +
                          std::to_string(topology_.num_ranks) + "), got " + std::to_string(rank));
  kernels::launch_set_mask(static_cast<int32_t*>(mask_.get()) + rank, masked ? 1 : 0, stream);
}

void BufferCore::query_mask(int32_t* out, cudaStream_t stream) {
  require_shrink("low_latency_query_mask_buffer");
  TURNOUT_CUDA_CHECK(
      cudaMemcpyAsync(out, mask_.get(), sizeof(int32_t) * topology_.num_ranks, cudaMemcpyDeviceToDevice, stream));
}

void BufferCore::clean_mask(cudaStream_t stream) {
  require_shrink("low_latency_clean_mask_buffer");
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(mask_.get(), 0, sizeof(int32_t) * topology_.num_ranks, stream));
}

void BufferCore::require_shrink(const char* op) const {
  require_alive(op);
  if (!options_.enable_shrink)
    throw InvalidArgument(std::string(op) + ": this buffer was created without enable_shrink=True");
}

HostClock::time_point BufferCore::host_deadline(HostClock::time_point start) const {
  return start + std::chrono::duration_cast<HostClock::duration>(std::chrono::duration<double>(host_limit_s()));
}

void BufferCore::check_errors(const char* op) {
  errors_.check(op, first_peer_rank_, last_dispatch_call_);
}

void BufferCore::join(cudaStream_t waiter, cudaStream_t waited) {
  require_alive("join");
  if (waiter == waited) return;
  TURNOUT_CUDA_CHECK(cudaEventRecord(join_event_.get(), waited));
  TURNOUT_CUDA_CHECK(cudaStreamWaitEvent(waiter, join_event_.get(), 0));
}

bool BufferCore::follow(cudaStream_t waiter, cudaStream_t waited) {
  require_alive("follow");
  if (waiter == waited) return false;
  cudaStreamCaptureStatus waiter_status, waited_status;
  unsigned long long waiter_id = 0, waited_id = 0;
  TURNOUT_CUDA_CHECK(cudaStreamGetCaptureInfo(waiter, &waiter_status, &waiter_id));
  TURNOUT_CUDA_CHECK(cudaStreamGetCaptureInfo(waited, &waited_status, &waited_id));
  // A wait across a capture's boundary is an error (a capture waiting on work
  // outside it) or pulls eager work into a graph; the stream a replay is
  // launched on orders it.
  if (waiter_status != waited_status || waiter_status == cudaStreamCaptureStatusInvalidated) return false;
  if (waiter_status == cudaStreamCaptureStatusActive && waiter_id != waited_id) return false;
  join(waiter, waited);
  return true;
}

void BufferCore::synchronize(cudaStream_t stream, const char* op) {
  require_alive(op);
  TURNOUT_CUDA_CHECK(cudaEventRecord(sync_event_.get(), stream));
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
  if (!host_wait(op, host_deadline(HostClock::now()), kShortWait, done, timed_out))
    throw TimeoutError(std::string(op) + ": rank " + std::to_string(topology_.rank) +
                       ": the GPU did not finish within " + std::to_string(host_limit_s()) + " s");
  check_errors(op);
}

void BufferCore::barrier(cudaStream_t stream, bool shrinkable) {
  require_alive("barrier");
  check_errors("barrier");
  if (nvshmem_ && low_latency_symmetric_.get() == nullptr) {
    // Internode normal mode (no low-latency region to meet in): NVSHMEM's
    // barrier, which has no timeout and knows no mask.
    nvshmem_->barrier(stream);
    return;
  }
  begin_call();
  if (nvshmem_) {
    // Every rank of the group, across domains, over the low-latency
    // transport: bounded, and shrink mode aware.
    kernels::low_latency::BarrierArgs args;
    args.area = static_cast<int64_t>(low_latency_bytes_);
    launch_group_barrier(args, wait_context(OpKind::kBarrier, shrinkable), stream);
    return;
  }
  kernels::launch_barrier(nvl_->device_table(), topology_.nvl_rank(), topology_.num_nvl_ranks,
                          wait_context(OpKind::kBarrier, shrinkable), stream);
}

}  // namespace turnout
