// BufferOptions the Buffer checks itself before anything else: a bad one is
// refused naming the option, before any collective step or CUDA call.
#include <gtest/gtest.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "turnout/bootstrap.hpp"
#include "turnout/buffer.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

TEST(BufferOptions, QueuePairsPerRankMustBePositive) {
  FunctionBootstrap bootstrap(0, 2, [](std::span<const std::byte>) -> std::vector<std::byte> {
    ADD_FAILURE() << "the Buffer met its peers before checking its options";
    return {};
  });
  for (int bad : {0, -3}) {
    BufferOptions options;
    options.num_qps_per_rank = bad;
    try {
      Buffer buffer(bootstrap, options);
      ADD_FAILURE() << "num_qps_per_rank " << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("num_qps_per_rank"), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(bad)), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace turnout
