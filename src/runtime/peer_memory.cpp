#include "runtime/peer_memory.hpp"

#include <unistd.h>

#include <cstring>
#include <string>

#include "turnout/error.hpp"

namespace turnout {
namespace {

struct PeerInfo {
  cudaIpcMemHandle_t handle;
  uint64_t host_id;
  int64_t pid;
  uint64_t bytes;
};

}  // namespace

PeerMemory::PeerMemory(Bootstrap& bootstrap, const Topology& topology, size_t bytes)
    : bytes_(bytes), local_(allocate_device(bytes)) {
  // Zeroed and complete before its handle leaves this process.
  TURNOUT_CUDA_CHECK(cudaMemset(local_.get(), 0, bytes));
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());

  PeerInfo mine{};
  TURNOUT_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, local_.get()));
  mine.host_id = local_host_id();
  mine.pid = getpid();
  mine.bytes = bytes;
  const auto gathered = bootstrap.all_gather(std::as_bytes(std::span(&mine, 1)));
  std::vector<PeerInfo> all(bootstrap.size());
  std::memcpy(all.data(), gathered.data(), all.size() * sizeof(PeerInfo));

  for (int nvl = 0; nvl < topology.num_nvl_ranks; ++nvl) {
    const int peer_rank = topology.nvl_peer_rank(nvl);
    const PeerInfo& info = all[peer_rank];
    if (info.bytes != bytes)
      throw InvalidArgument("peer memory: rank " + std::to_string(peer_rank) + " allocated " +
                            std::to_string(info.bytes) + " bytes, rank " + std::to_string(topology.rank) +
                            " allocated " + std::to_string(bytes) + " (num_nvl_bytes must match on every rank)");
    if (peer_rank == topology.rank) {
      peers_[nvl] = local_.get();
      continue;
    }
    // Ranks may share a GPU, but not a process: CUDA IPC opens only another
    // process's memory.
    if (info.host_id == mine.host_id && info.pid == mine.pid)
      throw InvalidArgument("peer memory: ranks " + std::to_string(topology.rank) + " and " +
                            std::to_string(peer_rank) + " are one process (pid " + std::to_string(mine.pid) +
                            "); turnout needs one process per rank");
    void* mapped = nullptr;
    TURNOUT_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, info.handle, cudaIpcMemLazyEnablePeerAccess));
    mappings_.emplace_back(mapped);
    peers_[nvl] = mapped;
  }
  table_ = allocate_device(sizeof(peers_));
  TURNOUT_CUDA_CHECK(cudaMemcpy(table_.get(), peers_.data(), sizeof(peers_), cudaMemcpyHostToDevice));
}

PeerMemory::~PeerMemory() {
  release();
}

void PeerMemory::release() {
  mappings_.clear();
  table_.reset();
  local_.reset();
  peers_.fill(nullptr);
}

}  // namespace turnout
