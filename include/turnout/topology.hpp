// Who is where: ranks that share a host reach each other over NVLink (one NVL
// domain); domains reach each other over RDMA.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace turnout {

// The largest NVL domain the kernels address (peer tables are this long).
inline constexpr int kMaxNvlRanks = 8;

struct Topology {
  int rank = 0;
  int num_ranks = 1;
  int num_nvl_ranks = 1;  // ranks per NVL domain; domains are contiguous rank blocks

  int nvl_rank() const { return rank % num_nvl_ranks; }
  int rdma_rank() const { return rank / num_nvl_ranks; }
  int num_rdma_ranks() const { return num_ranks / num_nvl_ranks; }
  bool single_nvl_domain() const { return num_nvl_ranks == num_ranks; }
  // Global rank of the NVL peer with local index `nvl` in this domain.
  int nvl_peer_rank(int nvl) const { return rdma_rank() * num_nvl_ranks + nvl; }
};

// Builds the topology from every rank's host id (rank order). Ranks of one host
// must be contiguous and every host must hold the same number. `forced_nvl_ranks`
// > 0 declares smaller domains (to run the internode protocol on one host).
Topology make_topology(int rank, std::span<const uint64_t> host_ids, int forced_nvl_ranks = 0);

// A stable id of this machine (hash of hostname and boot id).
uint64_t local_host_id();

}  // namespace turnout
