// The free-memory probe's handshake with its helper thread: every request is
// answered by a reading taken after it, a reading is taken once, and the
// thread goes with the probe. Without a GPU every reading is the driver's
// error, which must reach the caller the same way a value would.
#include <chrono>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "runtime/free_memory_probe.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A reading of the probe, or 0 where the driver has no device (it must then
// throw a CudaError that names the query).
size_t take_reading(FreeMemoryProbe& probe) {
  if (have_gpu()) return probe.take();
  try {
    probe.take();
  } catch (const CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("cudaMemGetInfo"), std::string::npos) << e.what();
    return 0;
  }
  ADD_FAILURE() << "take() returned a reading without a GPU";
  return 0;
}

TEST(FreeMemoryProbe, EveryRequestIsAnswered) {
  FreeMemoryProbe probe(0);
  for (int i = 0; i < 500; ++i) {
    probe.request();
    if (i % 3 == 0) probe.request();  // replaces the one before, not yet taken
    const size_t asked = take_reading(probe);
    const size_t direct = take_reading(probe);  // none pending: read on this thread
    if (have_gpu()) {
      EXPECT_GT(asked, 0u);
      EXPECT_GT(direct, 0u);
    }
  }
}

TEST(FreeMemoryProbe, GoesWithARequestPending) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) {
    FreeMemoryProbe probe(0);
    probe.request();
    if (i % 2) probe.request();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace
}  // namespace turnout
