// NVL domains: the ranks of a host, or smaller ones declared to emulate
// several hosts on one (nvl_domain_size, TURNOUT_NVL_DOMAIN_SIZE); a
// declaration that cannot hold is refused with the reason.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "turnout/buffer.hpp"
#include "turnout/error.hpp"
#include "turnout/topology.hpp"

namespace turnout {
namespace {

std::vector<uint64_t> hosts(int num_hosts, int per_host) {
  std::vector<uint64_t> ids;
  for (int h = 0; h < num_hosts; ++h)
    for (int r = 0; r < per_host; ++r) ids.push_back(1000 + h);
  return ids;
}

std::string message_of(int rank, const std::vector<uint64_t>& ids, int declared) {
  try {
    make_topology(rank, ids, declared);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(Topology, DomainIsTheHostUnlessDeclared) {
  const auto ids = hosts(2, 4);
  EXPECT_EQ(make_topology(5, ids, 0).num_nvl_ranks, 4);
  EXPECT_EQ(make_topology(5, hosts(1, 8), 0).num_nvl_ranks, 8);
  const Topology t = make_topology(5, hosts(1, 8), 2);
  EXPECT_EQ(t.num_nvl_ranks, 2);
  EXPECT_EQ(t.num_rdma_ranks(), 4);
  EXPECT_EQ(t.nvl_rank(), 1);
  EXPECT_EQ(t.nvl_peer_rank(0), 4);
}

TEST(Topology, DeclaredSizeMustDivideTheHost) {
  EXPECT_NE(message_of(0, hosts(1, 8), 3).find("must divide the 8 ranks of one host"), std::string::npos);
  EXPECT_NE(message_of(0, hosts(2, 4), 8).find("must divide the 4 ranks of one host"), std::string::npos);
  EXPECT_NE(message_of(0, hosts(1, 8), 3).find("TURNOUT_NVL_DOMAIN_SIZE"), std::string::npos);
  EXPECT_EQ(message_of(0, hosts(1, 8), 4), "");
}

class DomainSizeEnv : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("TURNOUT_NVL_DOMAIN_SIZE"); }
};

TEST_F(DomainSizeEnv, UnsetMeansTheHost) {
  unsetenv("TURNOUT_NVL_DOMAIN_SIZE");
  EXPECT_EQ(default_nvl_domain_size(), 0);
}

TEST_F(DomainSizeEnv, ReadsAPositiveCount) {
  setenv("TURNOUT_NVL_DOMAIN_SIZE", "2", 1);
  EXPECT_EQ(default_nvl_domain_size(), 2);
}

TEST_F(DomainSizeEnv, RefusesAnythingElseByName) {
  for (const char* bad : {"0", "-2", "two", "2x", "4.0"}) {
    setenv("TURNOUT_NVL_DOMAIN_SIZE", bad, 1);
    try {
      default_nvl_domain_size();
      ADD_FAILURE() << "TURNOUT_NVL_DOMAIN_SIZE=" << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("TURNOUT_NVL_DOMAIN_SIZE"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace turnout
