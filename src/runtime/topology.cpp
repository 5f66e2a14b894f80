#include "turnout/topology.hpp"

#include <unistd.h>

#include <fstream>
#include <functional>
#include <string>

#include "turnout/error.hpp"

namespace turnout {

Topology make_topology(int rank, std::span<const uint64_t> host_ids, int forced_nvl_ranks) {
  const int num_ranks = static_cast<int>(host_ids.size());
  if (num_ranks < 1) throw InvalidArgument("topology: no ranks");
  if (rank < 0 || rank >= num_ranks)
    throw InvalidArgument("topology: rank " + std::to_string(rank) + " outside [0, " + std::to_string(num_ranks) + ")");
  int nvl = 1;
  while (nvl < num_ranks && host_ids[nvl] == host_ids[0]) ++nvl;
  if (forced_nvl_ranks > 0) {
    if (forced_nvl_ranks > nvl || nvl % forced_nvl_ranks != 0)
      throw InvalidArgument("the declared NVL domain size (nvl_domain_size or TURNOUT_NVL_DOMAIN_SIZE) " +
                            std::to_string(forced_nvl_ranks) + " must divide the " + std::to_string(nvl) +
                            " ranks of one host");
    nvl = forced_nvl_ranks;
  }
  if (num_ranks % nvl != 0)
    throw InvalidArgument("topology: hosts hold different numbers of ranks (first host " + std::to_string(nvl) +
                          ", total " + std::to_string(num_ranks) + ")");
  // Every NVL domain must lie on one host.
  for (int r = 0; r < num_ranks; ++r) {
    const int domain_start = r / nvl * nvl;
    if (host_ids[r] != host_ids[domain_start])
      throw InvalidArgument("topology: rank " + std::to_string(r) + " is not on the host of rank " +
                            std::to_string(domain_start) + " (ranks of one host must be contiguous)");
  }
  if (nvl > kMaxNvlRanks)
    throw NotSupported("topology: " + std::to_string(nvl) + " ranks per NVL domain, at most " +
                       std::to_string(kMaxNvlRanks));
  return Topology{rank, num_ranks, nvl};
}

uint64_t local_host_id() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string id = name;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot >> boot_id) id += "/" + boot_id;
  return std::hash<std::string>{}(id);
}

}  // namespace turnout
