// The communication buffer of one rank: the facade of every mode's ops.
// Usable from C++ alone: raw device pointers and CUDA streams. What the ops
// share (peer memory, streams, the error word) and each mode's own state live
// behind it, in src/.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "turnout/bootstrap.hpp"
#include "turnout/internode.hpp"
#include "turnout/intranode.hpp"
#include "turnout/layout.hpp"
#include "turnout/low_latency.hpp"
#include "turnout/topology.hpp"

namespace turnout {

// Seconds, from TURNOUT_TIMEOUT_S if set (and valid), else 100.
double default_timeout_s();
// The declared NVL domain size from TURNOUT_NVL_DOMAIN_SIZE (0 when unset:
// the ranks of a host); throws InvalidArgument on a value that is no
// positive integer.
int default_nvl_domain_size();
// Seconds a shrink-mode wait gives a peer before masking it, from
// TURNOUT_SHRINK_TIMEOUT_S if set (and valid), else 5.
double default_shrink_timeout_s();

struct BufferOptions {
  size_t num_nvl_bytes = 0;
  size_t num_rdma_bytes = 0;
  bool low_latency_mode = false;
  double timeout_s = 0;  // <= 0: default_timeout_s()
  // Across NVL domains (NVSHMEM): IBGDA queue pairs per peer rank (>= 1).
  int num_qps_per_rank = 24;
  // Across NVL domains: false sends every low-latency peer through NVSHMEM,
  // also the peers within this rank's NVL domain.
  bool allow_nvlink_for_low_latency_mode = true;
  // Across NVL domains: let NVSHMEM use multi-node NVLink.
  bool allow_mnnvl = false;
  // > 0: declare NVL domains smaller than the hosts, to emulate several hosts
  // on one (0: TURNOUT_NVL_DOMAIN_SIZE if set, else the ranks of a host).
  // Every rank declares the same.
  int nvl_domain_size = 0;
  // Shrink mode: a peer that does not answer a low-latency call or a clean
  // within shrink_timeout_s is masked on this rank and the call goes on
  // without it (see the mask ops below).
  bool enable_shrink = false;
  double shrink_timeout_s = 0;  // <= 0: default_shrink_timeout_s()
  // The stream the ops of the Python layer run on. Null: the Buffer creates
  // (and owns) one. A caller's stream must outlive the Buffer; the Python layer
  // passes one from PyTorch's pool, which PyTorch never destroys, because
  // tensors may still record it after the Buffer is gone.
  cudaStream_t comm_stream = nullptr;
};

class Buffer {
 public:
  // Collective: every rank of `bootstrap` constructs its Buffer together, on
  // the CUDA device current when called.
  Buffer(Bootstrap& bootstrap, const BufferOptions& options);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Collective: waits for local work, meets the NVL peers (bounded by the
  // timeout) so none still touches our memory, then frees everything. In
  // shrink mode it never waits for a peer (peers keep their mappings of this
  // rank's memory alive until they free theirs); across NVL domains it meets
  // the unmasked ranks (bounded by the shrink timeout) to agree on NVSHMEM's
  // collective teardown, and where any rank is lost leaves NVSHMEM
  // initialized, its symmetric memory allocated, until the process exits.
  // Idempotent; the destructor calls it.
  void destroy();
  bool destroyed() const;

  const Topology& topology() const;
  int device() const;
  double timeout_s() const;
  // SMs one op may use: the GPU's SMs divided among the ranks of the NVL
  // domain that share it (the smallest share over the domain, even). A
  // config asking for more runs on this many; blocks spin waiting for peer
  // blocks, so every rank's blocks must fit on the GPUs at once.
  int sm_budget() const;
  // How peers map each other's memory: "vmm" (CUDA VMM shared by file
  // descriptor: a peer's memory stays valid while mapped, even after it dies)
  // or "ipc" (legacy CUDA IPC, where the group cannot use VMM).
  const char* peer_memory_kind() const;
  // Ranks of the NVL domain on this rank's GPU, this one included.
  int ranks_on_gpu() const;
  // Whether an intranode dispatch with its receive rows known, and a combine,
  // run their two steps as one launch: where ranks_on_gpu() is 1, or where
  // TURNOUT_ONE_LAUNCH=1 (set on every rank) says the sharing ranks' blocks
  // fit on the GPU at once.
  bool one_launch() const;
  size_t num_nvl_bytes() const;
  cudaStream_t comm_stream() const;
  // The user-visible part of this rank's NVL buffer (num_nvl_bytes bytes).
  void* local_nvl_buffer() const;
  // Device table of every NVL peer's user-visible buffer (kMaxNvlRanks entries).
  void* const* peer_nvl_table() const;

  // Errors a kernel finds (a timeout, a bad expert id, a receive count over
  // num_worst_tokens, a handle that does not fit) are raised by a later call:
  // the local op (layout) before its launch, the collective ones after all
  // their launches, so that no peer waits for a kernel this rank skipped; a
  // dispatch that waits for its counts raises there the errors of its own
  // call, on every rank. The message names the call that caused the error.
  // check_errors raises them at any time (after a CUDA-graph replay, say).

  // Layout adds into a workspace that each call leaves zeroed. A call
  // captured in a CUDA graph gets one of its own (4 MB hold about 3600
  // with 256 experts), so replays may overlap eager calls; eager calls share one,
  // so they must not overlap each other (one stream, or streams joined, as the Python layer).
  void get_dispatch_layout(const LayoutArgs& args, cudaStream_t stream);

  // The collective ops of one Buffer share its work areas: issue them so they
  // do not overlap (one stream, or streams joined in turn, as the Python layer does).
  // Intranode dispatch, step 1: exchange the counts. Unless num_worst_tokens >
  // 0 the host then waits for them (bounded by the timeout; a TimeoutError
  // names the ranks that did not answer) and returns the receive sizes; that
  // wait is refused while `stream` is capturing a CUDA graph.
  DispatchCounts dispatch_counts(const DispatchCountsArgs& args, cudaStream_t stream);
  // Step 2: move the tokens into outputs sized from step 1 (or the handle).
  void dispatch(const DispatchArgs& args, cudaStream_t stream);
  // Both steps, where the receive rows are known before the counts: with
  // num_worst_tokens > 0 (outputs of that many rows), or a cached dispatch
  // (the handle's rows; no num_tokens_per_expert). Where no other rank of the
  // group shares this GPU, one launch (the counts step in its first block).
  void dispatch_known_rows(const DispatchCountsArgs& counts, const DispatchArgs& args, cudaStream_t stream);
  // Seconds the last host wait for receive counts took (of this buffer's
  // normal mode, intranode or internode), until they arrived: what a
  // dispatch's host time is counted without.
  double last_host_wait_s() const;
  // Sends expert outputs back to their source ranks and reduces them there.
  void combine(const CombineArgs& args, cudaStream_t stream);

  // Internode normal mode (turnout/internode.hpp), on a buffer whose group
  // spans NVL domains, built with num_rdma_bytes > 0 and without
  // low_latency_mode. The same two steps and host wait as intranode; a bad
  // input on any rank raises on every rank.
  InternodeDispatchCounts internode_dispatch_counts(const InternodeDispatchCountsArgs& args, cudaStream_t stream);
  void internode_dispatch(const InternodeDispatchArgs& args, cudaStream_t stream);
  void internode_combine(const InternodeCombineArgs& args, cudaStream_t stream);
  // Bytes of the network region (0 unless internode mode opened it).
  size_t num_internode_bytes() const;

  // Low-latency mode (turnout/low_latency.hpp), on a buffer built with
  // low_latency_mode: no host sync, no allocation, CUDA-graph safe. A bad
  // expert id is found on the device and raised by a later call (see above);
  // every other bad argument raises here, before anything is launched.
  void low_latency_dispatch(const LowLatencyDispatchArgs& args, LowLatencyPhase phase, cudaStream_t stream);
  void low_latency_combine(const LowLatencyCombineArgs& args, LowLatencyPhase phase, cudaStream_t stream);
  // Collective: resets the low-latency region (after a failed call, say).
  // In shrink mode only the unmasked ranks meet, and one that does not come
  // is masked. The next calls are numbered from first_call (every rank the
  // same; other than 1 only to test numbers far from the start).
  void clean_low_latency_buffer(cudaStream_t stream, uint64_t first_call = 1);
  // The number of the last finished call of each low-latency phase: dispatch
  // send, dispatch receive, combine send, combine receive. A diagnostic: it
  // copies from the GPU synchronously (no call of this buffer may run).
  std::array<uint64_t, 4> low_latency_call_numbers();

  // Shrink mode (enable_shrink): this rank's mask, one int32 per rank, 1 =
  // masked. A masked rank is neither sent to nor waited for: low-latency
  // dispatch leaves out its tokens, combine the top-k slots of its experts.
  // Each rank keeps its own mask, changed by its waits' timeouts and by
  // these calls, in order on `stream`. A masked rank that comes back is
  // ignored until every rank unmasks it and then calls clean_low_latency_buffer.
  void update_mask(int rank, bool masked, cudaStream_t stream);
  // Copies the mask (num_ranks int32) to device memory at `out`.
  void query_mask(int32_t* out, cudaStream_t stream);
  void clean_mask(cudaStream_t stream);
  bool shrink_enabled() const;
  double shrink_timeout_s() const;
  // Bytes of the low-latency part of each rank's buffer (0 without low_latency_mode).
  size_t num_low_latency_bytes() const;

  // Every NVL peer meets here (a device barrier on `stream`, bounded by the
  // timeout); a peer that never comes leaves a timeout record. Where
  // low-latency mode spans NVL domains, every rank of the group meets.
  void barrier(cudaStream_t stream);

  // Copies `bytes` from `src` into every NVL peer's buffer (this rank's own
  // too if include_self) at dst_offset + this rank's nvl_rank * bytes, with
  // 16-byte SM stores from `warps_per_block` warps (1-32) on each of `num_sms`
  // blocks, or with bulk copies through each block's shared memory (sm_90's
  // cp.async.bulk; one thread a block, whatever `warps_per_block`). SM stores
  // keep `words_in_flight` 16-byte loads a lane (1, 2, 4 or 8) in flight before
  // their stores. The NVLink ceiling of the bench.
  void store_to_peers(const void* src, size_t bytes, size_t dst_offset, bool include_self, int num_sms,
                      cudaStream_t stream, bool bulk_copies = false, int warps_per_block = 16, int words_in_flight = 1);
  // Reads [src_offset, src_offset + bytes) of every NVL peer's buffer (this
  // rank's own too if include_self) into dst + the peer's nvl_rank * bytes
  // (dst holds num_nvl_ranks * bytes), with 16-byte SM loads from
  // `warps_per_block` warps on each of `num_sms` blocks, `words_in_flight`
  // loads a lane and peer (1, 2, 4, 8, or 16 with at most 16 warps a block)
  // before their stores. The bench's NVLink ceiling for reads.
  void load_from_peers(void* dst, size_t bytes, size_t src_offset, int num_sms, cudaStream_t stream,
                       bool include_self = true, int warps_per_block = 16, int words_in_flight = 1);

  // Makes `waiter` wait for the work enqueued on `waited` so far (one reused
  // event: cheaper than a fresh one per call).
  void join(cudaStream_t waiter, cudaStream_t waited);
  // join, unless the two streams are not in the same CUDA-graph capture (or
  // both outside any): a capture must not wait on work outside it. Returns
  // whether it joined.
  bool follow(cudaStream_t waiter, cudaStream_t waited);

  // Throws the error a kernel recorded, if any (see above).
  void check_errors(const char* op);
  // Host wait for `stream`, polling the error word; raises TimeoutError if the
  // GPU has not finished within the timeout (+2 s for the kernels' own).
  void synchronize(cudaStream_t stream, const char* op);

 private:
  // The state every op shares, then each mode's own (src/buffer.cpp).
  struct State;
  std::unique_ptr<State> state_;
};

// True if this build holds sm_90 machine code.
bool is_sm90_compiled();

}  // namespace turnout
