// One device allocation per rank, mapped by every other rank of the NVL
// domain, so kernels can load and store straight into peers' memory.
//
// The allocation comes from the CUDA virtual memory management API: each rank
// creates it (cuMemCreate), exports it as a POSIX file descriptor, and hands
// that to its peers over Unix sockets (runtime/fd_passing.hpp), which import
// and map it. The driver counts references to the physical memory, so a
// peer's mapping keeps it alive and valid after its owner frees it or dies.
// Shrink mode needs exactly that: survivors go on storing into a dead rank's
// memory until they notice, and a survivor may free its own without waiting
// for peers. With legacy CUDA IPC the owner's exit (or free) returns the
// pages to the driver while peers still map them, and their stores then land
// in whatever reuses the pages (under MPS, the survivors' own allocations).
//
// Legacy CUDA IPC remains as the fallback: the whole group uses it when any
// rank's device lacks VMM or POSIX file descriptor export, or any rank fails
// to allocate, export, exchange or map. The environment variable
// TURNOUT_PEER_MEMORY chooses: unset or "auto" as just said, "ipc" forces
// legacy IPC (on any rank: the group follows), "vmm" makes falling back an
// error.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "runtime/cuda_resources.hpp"
#include "runtime/vmm.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/topology.hpp"

namespace turnout {

class PeerMemory {
 public:
  enum class Kind { kVmm, kIpc };

  // Collective over `bootstrap`: every rank calls it with the same `bytes`.
  // The local allocation is zeroed before any peer can see it. `timeout_s`
  // bounds the exchange of file descriptors between the domain's ranks.
  PeerMemory(Bootstrap& bootstrap, const Topology& topology, size_t bytes, double timeout_s);
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;
  ~PeerMemory();

  size_t bytes() const { return bytes_; }
  void* local() const { return local_; }
  // This process's address of NVL peer `nvl_rank`'s allocation (local() for self).
  void* peer(int nvl_rank) const { return peers_[nvl_rank]; }
  // The same table in device memory: kMaxNvlRanks entries, unused ones null.
  void* const* device_table() const { return static_cast<void* const*>(table_.get()); }
  // The same on every rank of the group.
  Kind kind() const { return kind_; }
  const char* kind_name() const { return kind_ == Kind::kVmm ? "vmm" : "ipc"; }

  // Unmaps peers and frees the local allocation. With VMM, peers' mappings
  // keep it alive; with legacy IPC, call only when no peer can still touch it
  // (after a barrier). The destructor calls it too.
  void release();

 private:
  void map_with_ipc(Bootstrap& bootstrap, const Topology& topology);

  size_t bytes_;
  Kind kind_ = Kind::kIpc;
  // One of the two pairs is in use, as kind_ says. Peers' mappings are
  // declared after the local memory, so they go first.
  VmmMemory vmm_local_;
  std::vector<VmmMemory> vmm_peers_;
  DeviceMemory ipc_local_;
  std::vector<IpcMapping> ipc_peers_;
  void* local_ = nullptr;
  std::array<void*, kMaxNvlRanks> peers_{};
  DeviceMemory table_;
};

}  // namespace turnout
