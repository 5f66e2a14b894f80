#include "runtime/peer_memory.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/fd_passing.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

enum class Choice { kAuto, kIpc, kVmm };
constexpr const char* kForcedIpc = "TURNOUT_PEER_MEMORY=ipc";

// Why a rank cannot use VMM, as plain bytes for the all-gather (cut short).
using Reason = std::array<char, 200>;

Reason reason_of(const std::string& text) {
  Reason r{};
  std::memcpy(r.data(), text.data(), std::min(text.size(), r.size() - 1));
  return r;
}

std::string text_of(const Reason& r) {
  return std::string(r.data(), strnlen(r.data(), r.size()));
}

// The first round: who a rank is and whether it can use VMM.
struct RankInfo {
  uint64_t host_id;
  int64_t pid;
  uint64_t bytes;
  uint8_t vmm_ok;
  uint8_t vmm_required;
  uint64_t vmm_bytes;  // its allocation's size, rounded to the granularity
  FdAddress fd_address;
  Reason why_not;
};

// The second round, with VMM: whether a rank received and mapped every peer.
struct MapStatus {
  uint8_t vmm_ok;
  Reason why_not;
};

// The fallback round.
struct IpcInfo {
  cudaIpcMemHandle_t handle;
};

template <typename T>
std::vector<T> all_gather(Bootstrap& bootstrap, const T& mine) {
  static_assert(std::is_trivially_copyable_v<T>);
  const auto gathered = bootstrap.all_gather(std::as_bytes(std::span(&mine, 1)));
  std::vector<T> all(bootstrap.size());
  std::memcpy(all.data(), gathered.data(), all.size() * sizeof(T));
  return all;
}

Choice choice_from_env() {
  const char* env = std::getenv("TURNOUT_PEER_MEMORY");
  const std::string v = env ? env : "";
  if (v.empty() || v == "auto") return Choice::kAuto;
  if (v == "ipc") return Choice::kIpc;
  if (v == "vmm") return Choice::kVmm;
  throw InvalidArgument("TURNOUT_PEER_MEMORY must be auto, vmm or ipc, got '" + v + "'");
}

std::chrono::milliseconds to_ms(double seconds) {
  // Huge values mean "no limit"; the exchange caps its own deadline.
  return std::chrono::milliseconds(static_cast<int64_t>(std::clamp(seconds * 1e3, 1.0, 1e15)));
}

// Every rank sees the same gathered data, so every rank throws alike.
void check_group(const std::vector<RankInfo>& all, const Topology& topology, size_t bytes) {
  for (int r = 0; r < topology.num_ranks; ++r)
    if (all[r].bytes != bytes)
      throw InvalidArgument("peer memory: rank " + std::to_string(r) + " allocated " + std::to_string(all[r].bytes) +
                            " bytes, rank " + std::to_string(topology.rank) + " allocated " + std::to_string(bytes) +
                            " (num_nvl_bytes must match on every rank)");
  // Ranks may share a GPU, but not a process: neither IPC nor a file
  // descriptor opens memory of one's own process.
  for (int a = 0; a < topology.num_ranks; ++a)
    for (int b = a + 1; b < topology.num_ranks && b / topology.num_nvl_ranks == a / topology.num_nvl_ranks; ++b)
      if (all[a].host_id == all[b].host_id && all[a].pid == all[b].pid)
        throw InvalidArgument("peer memory: ranks " + std::to_string(a) + " and " + std::to_string(b) +
                              " are one process (pid " + std::to_string(all[a].pid) +
                              "); turnout needs one process per rank");
}

// The lowest rank that cannot use VMM, or -1.
template <typename T>
int first_failed(const std::vector<T>& all) {
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].vmm_ok) return static_cast<int>(r);
  return -1;
}

}  // namespace

PeerMemory::PeerMemory(Bootstrap& bootstrap, const Topology& topology, size_t bytes, double timeout_s) : bytes_(bytes) {
  const Choice choice = choice_from_env();
  int device = 0;
  TURNOUT_CUDA_CHECK(cudaGetDevice(&device));
  // Makes the device's primary context current (CUDA 12 and later), which
  // the driver calls below expect.
  TURNOUT_CUDA_CHECK(cudaSetDevice(device));

  RankInfo mine{};
  mine.host_id = local_host_id();
  mine.pid = getpid();
  mine.bytes = bytes;
  mine.vmm_required = choice == Choice::kVmm;
  std::unique_ptr<FdExchange> exchange;
  UniqueFd exported;
  std::string why_not = kForcedIpc;
  if (choice != Choice::kIpc) {
    try {
      why_not = vmm_unsupported_reason(device);
      if (why_not.empty()) {
        vmm_local_ = VmmMemory::create(device, bytes);
        // Zeroed and complete before its descriptor leaves this process.
        TURNOUT_CUDA_CHECK(cudaMemset(vmm_local_.get(), 0, vmm_local_.size()));
        TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());
        exported = vmm_local_.export_fd();
        // Listening before the all-gather: peers connect right after it.
        exchange = std::make_unique<FdExchange>(topology.rank);
        mine.vmm_ok = 1;
        mine.vmm_bytes = vmm_local_.size();
        mine.fd_address = exchange->address();
      }
    } catch (const CudaError& e) {
      // A failed runtime call stays the thread's last error and would fail
      // the next launch check. An error that sticks to the context fails
      // legacy IPC too, and is reported from there.
      cudaGetLastError();
      why_not = e.what();
    } catch (const Error& e) {
      why_not = e.what();
    }
    if (!mine.vmm_ok) {
      exported.reset();
      vmm_local_.reset();
    }
  }
  mine.why_not = reason_of(why_not);
  const std::vector<RankInfo> all = all_gather(bootstrap, mine);
  check_group(all, topology, bytes);
  const bool required = std::any_of(all.begin(), all.end(), [](const RankInfo& i) { return i.vmm_required; });

  // VMM only if every rank of the group can: then every rank takes the same
  // number of all-gathers, whatever it finds.
  int failed = first_failed(all);
  std::string failure = failed >= 0 ? text_of(all[failed].why_not) : "";
  if (failed < 0) {
    MapStatus status{1, {}};
    try {
      std::vector<FdPeer> peers;
      for (int nvl = 0; nvl < topology.num_nvl_ranks; ++nvl)
        if (nvl != topology.nvl_rank()) {
          const int r = topology.nvl_peer_rank(nvl);
          peers.push_back({r, all[r].fd_address});
        }
      const std::vector<UniqueFd> fds = exchange->exchange(exported.get(), peers, to_ms(timeout_s));
      for (size_t i = 0; i < fds.size(); ++i)
        vmm_peers_.push_back(VmmMemory::import(fds[i].get(), all[peers[i].rank].vmm_bytes, device));
    } catch (const Error& e) {
      status = {0, reason_of(e.what())};
      vmm_peers_.clear();
    }
    // Peers that got our descriptor hold their own reference now.
    exported.reset();
    exchange.reset();
    const std::vector<MapStatus> statuses = all_gather(bootstrap, status);
    failed = first_failed(statuses);
    if (failed < 0) {
      kind_ = Kind::kVmm;
      local_ = vmm_local_.get();
      for (int nvl = 0, next = 0; nvl < topology.num_nvl_ranks; ++nvl)
        peers_[nvl] = nvl == topology.nvl_rank() ? local_ : vmm_peers_[next++].get();
    } else {
      failure = text_of(statuses[failed].why_not);
    }
  }

  if (failed >= 0) {
    if (required)
      throw NotSupported("peer memory: TURNOUT_PEER_MEMORY=vmm, but rank " + std::to_string(failed) +
                         " cannot use VMM peer memory: " + failure);
    exchange.reset();
    exported.reset();
    vmm_peers_.clear();
    vmm_local_.reset();
    // Once per group, and not when asked for.
    if (topology.rank == 0 && failure != kForcedIpc)
      std::fprintf(stderr, "turnout: peer memory falls back to legacy CUDA IPC (rank %d: %s)\n", failed,
                   failure.c_str());
    map_with_ipc(bootstrap, topology);
  }
  table_ = allocate_device(sizeof(peers_));
  TURNOUT_CUDA_CHECK(cudaMemcpy(table_.get(), peers_.data(), sizeof(peers_), cudaMemcpyHostToDevice));
}

void PeerMemory::map_with_ipc(Bootstrap& bootstrap, const Topology& topology) {
  ipc_local_ = allocate_device(bytes_);
  // Zeroed and complete before its handle leaves this process.
  TURNOUT_CUDA_CHECK(cudaMemset(ipc_local_.get(), 0, bytes_));
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());
  IpcInfo mine{};
  TURNOUT_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, ipc_local_.get()));
  const std::vector<IpcInfo> all = all_gather(bootstrap, mine);
  kind_ = Kind::kIpc;
  local_ = ipc_local_.get();
  for (int nvl = 0; nvl < topology.num_nvl_ranks; ++nvl) {
    if (nvl == topology.nvl_rank()) {
      peers_[nvl] = local_;
      continue;
    }
    void* mapped = nullptr;
    TURNOUT_CUDA_CHECK(
        cudaIpcOpenMemHandle(&mapped, all[topology.nvl_peer_rank(nvl)].handle, cudaIpcMemLazyEnablePeerAccess));
    ipc_peers_.emplace_back(mapped);
    peers_[nvl] = mapped;
  }
}

PeerMemory::~PeerMemory() {
  release();
}

void PeerMemory::release() {
  ipc_peers_.clear();
  vmm_peers_.clear();
  table_.reset();
  ipc_local_.reset();
  vmm_local_.reset();
  local_ = nullptr;
  peers_.fill(nullptr);
}

}  // namespace turnout
