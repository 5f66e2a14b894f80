// What every op of a Buffer shares: who the rank is, its streams, its peer
// memory, the error word and the call count. Each mode keeps its own state
// beside it (src/ops/<mode>/) and reaches the peers through it.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/low_latency/group_barrier.hpp"
#include "kernels/wait_context.hpp"
#include "runtime/cuda_resources.hpp"
#include "runtime/device_error.hpp"
#include "runtime/host_wait.hpp"
#include "runtime/nvshmem_loader.hpp"
#include "runtime/nvshmem_window.hpp"
#include "runtime/peer_memory.hpp"
#include "turnout/buffer.hpp"

namespace turnout {

class BufferCore {
 public:
  // Collective over `bootstrap`: learns the group, maps the peers' memory.
  BufferCore(Bootstrap& bootstrap, const BufferOptions& options);

  // Meets the peers (unless one already failed to arrive), then frees.
  void destroy();
  bool destroyed() const { return !nvl_; }
  void require_alive(const char* op) const;
  // Throws unless the buffer is alive and in shrink mode.
  void require_shrink(const char* op) const;

  const BufferOptions& options() const { return options_; }
  const Topology& topology() const { return topology_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  int sm_budget() const { return sm_budget_; }
  int ranks_on_gpu() const { return ranks_on_gpu_; }
  // Buffer::one_launch (every block of the launch resident at once).
  bool one_launch() const { return one_launch_; }
  cudaStream_t comm_stream() const { return comm_stream_; }
  const PeerMemory& nvl() const { return *nvl_; }
  void* local_nvl_buffer() const;
  void* const* peer_nvl_table() const;
  // Low-latency mode's region (num_rdma_bytes, rounded up; 0 and null
  // without low_latency_mode): part of the peer allocation within one NVL
  // domain, NVSHMEM symmetric memory when the group spans several (or keeps
  // NVLink out of low-latency mode). Its group is every rank.
  size_t low_latency_bytes() const { return low_latency_bytes_; }
  void* local_low_latency() const { return local_low_latency_; }
  // Device table of every rank's low-latency region as this process reaches
  // it by stores, null where only NVSHMEM reaches it.
  void* const* low_latency_table() const { return static_cast<void* const*>(low_latency_table_.get()); }
  // The same table on the host.
  const std::vector<void*>& low_latency_regions() const { return low_latency_regions_; }
  // The NVSHMEM library's table where low-latency mode runs over NVSHMEM, else null.
  const NvshmemApi* low_latency_nvshmem() const { return low_latency_nvshmem_; }
  // Internode normal mode's network region (num_rdma_bytes, rounded up, in
  // NVSHMEM symmetric memory; PE = rank): opened where the group spans NVL
  // domains without low_latency_mode and num_rdma_bytes > 0, else 0 and null.
  size_t internode_bytes() const { return internode_bytes_; }
  void* local_internode() const { return internode_symmetric_.get(); }
  // The NVSHMEM library's table where the network region is open, else null.
  const NvshmemApi* internode_nvshmem() const { return internode_nvshmem_; }
  bool timed_out() const { return errors_.timed_out(); }

  // Each op starts a call (numbered, so that an error names it); a dispatch
  // is remembered, since its counts step tells the peers of a layout error.
  int64_t begin_call() { return ++calls_; }
  int64_t begin_dispatch_call() { return last_dispatch_call_ = ++calls_; }
  DeviceErrorSlot error_slot(OpKind op) const { return errors_.device(op, calls_); }
  // Intranode combines that staged their inputs so far (the stage parity:
  // every rank of the group makes the same ones on this buffer).
  int64_t next_combine_stage() { return combine_stages_++; }
  // What the last counts step the host waited for posted of the receive
  // rows; taken by the data step after it (most < 0: not known).
  struct CountedRows {
    int most = -1;      // the most any rank receives
    int own_begin = 0;  // this rank's rows from itself: [own_begin, own_begin + own)
    int own = 0;
  };
  void set_counted_rows(const CountedRows& rows) { counted_rows_ = rows; }
  CountedRows take_counted_rows() { return std::exchange(counted_rows_, CountedRows{}); }
  // The wait context of the current call. `shrinkable`: in shrink mode its
  // waits mask a peer that does not come (after shrink_timeout_s times
  // `patience`) instead of failing.
  kernels::WaitContext wait_context(OpKind op, bool shrinkable = false, int patience = 1) const;
  bool shrink_enabled() const { return options_.enable_shrink; }
  // The rank mask in device memory (shrink mode), else null.
  const int32_t* mask() const { return static_cast<const int32_t*>(mask_.get()); }
  double shrink_timeout_s() const { return shrink_timeout_s_; }
  void update_mask(int rank, bool masked, cudaStream_t stream);
  void query_mask(int32_t* out, cudaStream_t stream);
  void clean_mask(cudaStream_t stream);

  // When a host wait that starts at `start` gives up: the kernels' own
  // timeout plus a grace, so that their record names the missing peer.
  HostClock::time_point host_deadline(HostClock::time_point start) const;
  double host_limit_s() const;

  void check_errors(const char* op);
  void join(cudaStream_t waiter, cudaStream_t waited);
  bool follow(cudaStream_t waiter, cudaStream_t waited);
  void synchronize(cudaStream_t stream, const char* op);
  // Shrinkable: in shrink mode masked peers are skipped and a peer that
  // does not come is masked.
  void barrier(cudaStream_t stream, bool shrinkable = false);

 private:
  // NVSHMEM over the bootstrap, with a symmetric heap of `symmetric_bytes`.
  void open_nvshmem(Bootstrap& bootstrap, size_t symmetric_bytes);
  // NVSHMEM, the region in its symmetric memory, and which ranks it reaches by stores.
  void open_low_latency_over_nvshmem(Bootstrap& bootstrap);
  // NVSHMEM and internode mode's network region in its symmetric memory, zeroed.
  void open_internode_over_nvshmem(Bootstrap& bootstrap);
  // The device table of low_latency_table().
  void set_low_latency_table(const std::vector<void*>& regions);
  // Over NVSHMEM: the group barrier (kernels/low_latency/group_barrier.hpp).
  void launch_group_barrier(const kernels::low_latency::BarrierArgs& args, const kernels::WaitContext& wait,
                            cudaStream_t stream);
  // Destroy in shrink mode over NVSHMEM, after the device is synchronized
  // (`device_status`): the unmasked ranks meet and vote; true where this
  // rank, a peer it met, or its mask says a rank is lost (or the vote
  // failed), so NVSHMEM's collective teardown must not run.
  bool must_leave_nvshmem_alone(cudaError_t device_status);

  BufferOptions options_;
  double timeout_s_;
  double shrink_timeout_s_;
  int device_ = 0;
  Topology topology_;
  Stream owned_comm_stream_;
  cudaStream_t comm_stream_ = nullptr;
  Event sync_event_;
  Event join_event_;
  DeviceErrorWord errors_;
  DeviceMemory mask_;  // shrink mode: int32 per rank
  std::unique_ptr<PeerMemory> nvl_;
  // Low-latency mode across NVL domains: NVSHMEM, and the region in its
  // symmetric memory (freed before NVSHMEM is finalized).
  std::unique_ptr<NvshmemWindow> nvshmem_;
  NvshmemAllocation low_latency_symmetric_;
  const NvshmemApi* low_latency_nvshmem_ = nullptr;
  // Internode mode: its network region (freed before NVSHMEM is finalized).
  NvshmemAllocation internode_symmetric_;
  const NvshmemApi* internode_nvshmem_ = nullptr;
  size_t internode_bytes_ = 0;
  // Global rank of index 0 of the peers a wait names: the NVL domain's first,
  // or 0 where low-latency mode's group spans domains. Internode waits name
  // global ranks against the domain's first (a far one comes out whole).
  int first_peer_rank_ = 0;
  DeviceMemory peer_user_table_;
  DeviceMemory low_latency_table_;  // void* per rank
  std::vector<void*> low_latency_regions_;
  size_t low_latency_bytes_ = 0;
  void* local_low_latency_ = nullptr;
  int64_t calls_ = 0;
  int64_t last_dispatch_call_ = 0;
  int64_t combine_stages_ = 0;
  CountedRows counted_rows_;
  int sm_budget_ = 2;
  int ranks_on_gpu_ = 1;
  bool one_launch_ = true;
};

}  // namespace turnout
