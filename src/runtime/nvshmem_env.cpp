#include "runtime/nvshmem_env.hpp"

#include <cstdlib>
#include <limits>

#include "turnout/error.hpp"

namespace turnout {

std::vector<std::pair<std::string, std::string>> nvshmem_env_defaults(const NvshmemSettings& settings) {
  constexpr size_t kMiB = size_t{1} << 20;
  if (settings.num_qps_per_rank < 1)
    throw InvalidArgument("NVSHMEM settings: num_qps_per_rank must be >= 1, got " +
                          std::to_string(settings.num_qps_per_rank));
  if (settings.symmetric_bytes > std::numeric_limits<size_t>::max() - kNvshmemSymmetricMarginBytes - kMiB)
    throw InvalidArgument("NVSHMEM settings: symmetric_bytes " + std::to_string(settings.symmetric_bytes) +
                          " is too large");
  std::vector<std::pair<std::string, std::string>> env;
  // NVLink SHARP multicast stays off: turnout uses none, and setting it up
  // takes memory and fabric resources a job may not have.
  env.emplace_back("NVSHMEM_DISABLE_NVLS", "1");
  // NVSHMEM_DISABLE_P2P is left alone: one host's PEs (and the one-machine
  // tests) reach each other only through NVSHMEM's P2P transport; turnout
  // honours allow_nvlink_for_low_latency_mode in its own kernels instead.
  env.emplace_back("NVSHMEM_IB_ENABLE_IBGDA", "1");
  env.emplace_back("NVSHMEM_IBGDA_NUM_RC_PER_PE", std::to_string(settings.num_qps_per_rank));
  // DeepEP's bound is 2 * (max tokens per rank + 1); 1024 holds its 512.
  env.emplace_back("NVSHMEM_QP_DEPTH", "1024");
  env.emplace_back("NVSHMEM_CUMEM_GRANULARITY", std::to_string(size_t{1} << 29));
  // Left unset when allowed, so that NVSHMEM's own default (or the user's
  // value) decides.
  if (!settings.allow_mnnvl) env.emplace_back("NVSHMEM_DISABLE_MNNVL", "1");
  env.emplace_back("NVSHMEM_MAX_TEAMS", "7");
  const size_t wanted = settings.symmetric_bytes + kNvshmemSymmetricMarginBytes;
  if (wanted > kNvshmemDefaultSymmetricBytes)
    env.emplace_back("NVSHMEM_SYMMETRIC_SIZE", std::to_string((wanted + kMiB - 1) / kMiB * kMiB));
  return env;
}

void apply_nvshmem_env_defaults(const NvshmemSettings& settings) {
  for (const auto& [name, value] : nvshmem_env_defaults(settings)) setenv(name.c_str(), value.c_str(), 0);
}

}  // namespace turnout
