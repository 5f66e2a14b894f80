// Defaults for NVSHMEM's environment, as DeepEP sets them, applied before
// NVSHMEM reads any. A variable the user set always wins.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace turnout {

struct NvshmemSettings {
  // RC queue pairs per peer for IBGDA (BufferOptions::num_qps_per_rank).
  int num_qps_per_rank = 24;
  // Let NVSHMEM use multi-node NVLink (BufferOptions::allow_mnnvl).
  bool allow_mnnvl = false;
  // Bytes the caller will allocate from the symmetric heap.
  size_t symmetric_bytes = 0;
};

// NVSHMEM's own symmetric heap size when NVSHMEM_SYMMETRIC_SIZE is unset.
inline constexpr size_t kNvshmemDefaultSymmetricBytes = size_t{1} << 30;
// Headroom over the caller's bytes for NVSHMEM's internal allocations.
inline constexpr size_t kNvshmemSymmetricMarginBytes = size_t{256} << 20;

// (name, value) in the order they are applied; pure.
std::vector<std::pair<std::string, std::string>> nvshmem_env_defaults(const NvshmemSettings& settings);

// setenv(name, value, 0) for each default: a value already set is kept.
void apply_nvshmem_env_defaults(const NvshmemSettings& settings);

}  // namespace turnout
