// One device allocation per rank, opened by every other rank of the NVL domain
// through CUDA IPC, so kernels can load and store straight into peers' memory.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "runtime/cuda_resources.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/topology.hpp"

namespace turnout {

class PeerMemory {
 public:
  // Collective over `bootstrap`: every rank calls it with the same `bytes`.
  // The local allocation is zeroed before any peer can see it.
  PeerMemory(Bootstrap& bootstrap, const Topology& topology, size_t bytes);
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;
  ~PeerMemory();

  size_t bytes() const { return bytes_; }
  void* local() const { return local_.get(); }
  // This process's address of NVL peer `nvl_rank`'s allocation (local() for self).
  void* peer(int nvl_rank) const { return peers_[nvl_rank]; }
  // The same table in device memory: kMaxNvlRanks entries, unused ones null.
  void* const* device_table() const { return static_cast<void* const*>(table_.get()); }

  // Unmaps peers and frees the local allocation. Call only when no peer can
  // still touch it (after a barrier); the destructor calls it too.
  void release();

 private:
  size_t bytes_;
  DeviceMemory local_;
  std::vector<IpcMapping> mappings_;
  std::array<void*, kMaxNvlRanks> peers_{};
  DeviceMemory table_;
};

}  // namespace turnout
