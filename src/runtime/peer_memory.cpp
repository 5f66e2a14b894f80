#include "turnout/peer_memory.hpp"

#include <cstring>
#include <string>

#include "turnout/error.hpp"

namespace turnout {
namespace {

struct PeerInfo {
  cudaIpcMemHandle_t handle;
  int32_t device;
  int32_t reserved;
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
  TURNOUT_CUDA_CHECK(cudaGetDevice(&mine.device));
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
    if (info.device == mine.device)
      throw InvalidArgument("peer memory: ranks " + std::to_string(topology.rank) + " and " +
                            std::to_string(peer_rank) + " use the same GPU " + std::to_string(mine.device) +
                            " (one process per GPU)");
    void* mapped = nullptr;
    TURNOUT_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, info.handle, cudaIpcMemLazyEnablePeerAccess));
    mappings_.emplace_back(mapped);
    peers_[nvl] = mapped;
  }
  table_ = allocate_device(sizeof(peers_));
  TURNOUT_CUDA_CHECK(cudaMemcpy(table_.get(), peers_.data(), sizeof(peers_), cudaMemcpyHostToDevice));
}

PeerMemory::~PeerMemory() { release(); }

void PeerMemory::release() {
  mappings_.clear();
  table_.reset();
  local_.reset();
  peers_.fill(nullptr);
}

}  // namespace turnout
