// NVSHMEM's environment defaults (runtime/nvshmem_env.hpp): DeepEP's values,
// the settings that change them, and that a variable the user set wins.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/nvshmem_env.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

using Env = std::vector<std::pair<std::string, std::string>>;

std::optional<std::string> find(const Env& env, const std::string& name) {
  for (const auto& [n, v] : env)
    if (n == name) return v;
  return std::nullopt;
}

TEST(NvshmemEnv, DefaultSettingsGiveDeepEpsValuesInOrder) {
  const Env expected = {
      {"NVSHMEM_DISABLE_NVLS", "1"}, {"NVSHMEM_IB_ENABLE_IBGDA", "1"},           {"NVSHMEM_IBGDA_NUM_RC_PER_PE", "24"},
      {"NVSHMEM_QP_DEPTH", "1024"},  {"NVSHMEM_CUMEM_GRANULARITY", "536870912"}, {"NVSHMEM_DISABLE_MNNVL", "1"},
      {"NVSHMEM_MAX_TEAMS", "7"},
  };
  EXPECT_EQ(nvshmem_env_defaults({}), expected);
}

TEST(NvshmemEnv, P2pIsNeverDisabled) {
  for (const auto& [name, value] : nvshmem_env_defaults({.symmetric_bytes = size_t{4} << 30}))
    EXPECT_NE(name, "NVSHMEM_DISABLE_P2P");
}

TEST(NvshmemEnv, AllowMnnvlLeavesTheVariableUnset) {
  const Env env = nvshmem_env_defaults({.allow_mnnvl = true});
  EXPECT_EQ(find(env, "NVSHMEM_DISABLE_MNNVL"), std::nullopt);
  EXPECT_EQ(env.size(), nvshmem_env_defaults({}).size() - 1);
}

TEST(NvshmemEnv, QueuePairsPerRank) {
  EXPECT_EQ(find(nvshmem_env_defaults({.num_qps_per_rank = 3}), "NVSHMEM_IBGDA_NUM_RC_PER_PE"), "3");
  EXPECT_THROW(nvshmem_env_defaults({.num_qps_per_rank = 0}), InvalidArgument);
}

TEST(NvshmemEnv, SymmetricSizeOnlyAboveNvshmemsDefault) {
  constexpr size_t kMiB = size_t{1} << 20;
  // 768 MiB + the 256 MiB margin is exactly NVSHMEM's 1 GiB: nothing to set.
  EXPECT_EQ(find(nvshmem_env_defaults({.symmetric_bytes = 768 * kMiB}), "NVSHMEM_SYMMETRIC_SIZE"), std::nullopt);
  // One byte more: the sum, rounded up to a MiB.
  EXPECT_EQ(find(nvshmem_env_defaults({.symmetric_bytes = 768 * kMiB + 1}), "NVSHMEM_SYMMETRIC_SIZE"),
            std::to_string(1025 * kMiB));
  EXPECT_EQ(find(nvshmem_env_defaults({.symmetric_bytes = 2048 * kMiB}), "NVSHMEM_SYMMETRIC_SIZE"),
            std::to_string(2304 * kMiB));
  const Env env = nvshmem_env_defaults({.symmetric_bytes = 2048 * kMiB});
  EXPECT_EQ(env.back().first, "NVSHMEM_SYMMETRIC_SIZE");
}

// Unsets the variables the defaults name for one test, then puts back what
// the process had (so a preset one is unset after).
class NvshmemEnvApply : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& [name, value] : nvshmem_env_defaults({.symmetric_bytes = size_t{2} << 30})) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      unsetenv(name.c_str());
    }
  }
  void TearDown() override {
    for (const auto& [name, old] : saved_)
      if (old)
        setenv(name.c_str(), old->c_str(), 1);
      else
        unsetenv(name.c_str());
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST_F(NvshmemEnvApply, SetsEveryDefault) {
  const NvshmemSettings settings{.num_qps_per_rank = 5, .symmetric_bytes = size_t{2} << 30};
  apply_nvshmem_env_defaults(settings);
  for (const auto& [name, value] : nvshmem_env_defaults(settings)) {
    const char* now = std::getenv(name.c_str());
    ASSERT_NE(now, nullptr) << name;
    EXPECT_EQ(std::string(now), value) << name;
  }
}

TEST_F(NvshmemEnvApply, NeverOverridesAPresetVariable) {
  setenv("NVSHMEM_QP_DEPTH", "4096", 1);
  setenv("NVSHMEM_DISABLE_MNNVL", "0", 1);
  setenv("NVSHMEM_SYMMETRIC_SIZE", "123456789", 1);
  apply_nvshmem_env_defaults({.symmetric_bytes = size_t{2} << 30});
  EXPECT_STREQ(std::getenv("NVSHMEM_QP_DEPTH"), "4096");
  EXPECT_STREQ(std::getenv("NVSHMEM_DISABLE_MNNVL"), "0");
  EXPECT_STREQ(std::getenv("NVSHMEM_SYMMETRIC_SIZE"), "123456789");
  // The ones not preset still get their defaults.
  EXPECT_STREQ(std::getenv("NVSHMEM_MAX_TEAMS"), "7");
}

}  // namespace
}  // namespace turnout
