// Who forwards what across NVL domains when some ranks are masked (shrink
// mode, docs/INTERNODE.md "Shrink across domains"). Rank r is local index
// ("column") r % D of domain r / D. A token of source (s, n) reaches domain e
// through one rank of e, its forwarder: (e, n) itself when live, else the next
// live local index of e after n, cyclically; a domain with no live rank has
// none (and no token reaches it). A live rank serves its own column and the
// masked columns it substitutes for (those just before it, cyclically); its
// network rings are split into one part per column served, parts in column
// order, so its forward order (source domain, part, token) is source rank,
// then token. Every rank derives the same plan from the same live set: the
// plan needs no agreement beyond that set.
//
// Shared by the host reference (tests/reference/internode.cpp) and the
// kernels: no CUDA header, __host__ __device__ only under nvcc. D <= 32
// (column sets are uint32); any number of domains.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TURNOUT_FORWARDERS_HD __host__ __device__
#else
#define TURNOUT_FORWARDERS_HD
#endif

namespace turnout::kernels::internode {

// A set of the group's ranks: bit r & 31 of word r >> 5, the layout of the
// low-latency kernels' PeerSet (low_latency/peer_set.cuh), which holds up to
// kMaxGroupRanks (1024) ranks. rank_set_words(R) words hold a group of R.
TURNOUT_FORWARDERS_HD constexpr int rank_set_words(int num_ranks) {
  return (num_ranks + 31) / 32;
}

TURNOUT_FORWARDERS_HD inline bool rank_in_set(const uint32_t* set, int rank) {
  return (set[rank >> 5] >> (rank & 31) & 1u) != 0;
}

inline constexpr int kNoForwarder = -1;

// The plan of one call. `live` null: every rank takes part (no shrink mode).
struct Forwarders {
  const uint32_t* live;
  int num_domains;    // N
  int num_nvl_ranks;  // D

  TURNOUT_FORWARDERS_HD bool is_live(int domain, int local) const {
    return live == nullptr || rank_in_set(live, domain * num_nvl_ranks + local);
  }

  // The local index of the rank that forwards column `column` into `domain`,
  // or kNoForwarder when no rank of `domain` is live.
  TURNOUT_FORWARDERS_HD int forwarder(int domain, int column) const {
    for (int k = 0; k < num_nvl_ranks; ++k) {
      const int m = column + k < num_nvl_ranks ? column + k : column + k - num_nvl_ranks;
      if (is_live(domain, m)) return m;
    }
    return kNoForwarder;
  }

  // Bit m: rank (domain, local) forwards column m (0 when it is masked).
  TURNOUT_FORWARDERS_HD uint32_t served(int domain, int local) const {
    if (!is_live(domain, local)) return 0;
    uint32_t columns = 1u << local;
    for (int k = 1; k < num_nvl_ranks; ++k) {
      const int m = local >= k ? local - k : local - k + num_nvl_ranks;
      if (is_live(domain, m)) break;
      columns |= 1u << m;
    }
    return columns;
  }

  // Parts of the rank's rings: the columns it serves (0 when it is masked).
  TURNOUT_FORWARDERS_HD int num_parts(int domain, int local) const { return count_below(served(domain, local), 32); }

  // The part that sources of column `column` use in the rings of their
  // forwarder in `domain`, or -1 when the domain has no forwarder.
  TURNOUT_FORWARDERS_HD int part(int domain, int column) const {
    const int f = forwarder(domain, column);
    return f == kNoForwarder ? -1 : count_below(served(domain, f), column);
  }

  // The column that part p of rank (domain, local) serves, or -1 past its parts.
  TURNOUT_FORWARDERS_HD int served_column(int domain, int local, int p) const {
    const uint32_t columns = served(domain, local);
    for (int m = 0; m < num_nvl_ranks; ++m)
      if (columns >> m & 1u) {
        if (p == 0) return m;
        --p;
      }
    return -1;
  }

 private:
  // Set bits of `bits` below bit `end` (end <= 32).
  TURNOUT_FORWARDERS_HD static int count_below(uint32_t bits, int end) {
    int count = 0;
    for (int m = 0; m < end; ++m) count += static_cast<int>(bits >> m & 1u);
    return count;
  }
};

}  // namespace turnout::kernels::internode

#undef TURNOUT_FORWARDERS_HD
