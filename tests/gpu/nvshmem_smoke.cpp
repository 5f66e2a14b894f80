// The NVSHMEM transport's first steps, no Python: one process per rank
// (round-robin over the GPUs) bootstrapped over TCP. Each rank opens an
// NvshmemWindow (twice in a row: NVSHMEM is finalized and initialized again),
// sees a second window refused while one is open, allocates symmetric memory
// and runs the ring kernel of libturnout_nvshmem.so: PE p puts p + 1000 into
// PE (p + 1) % n and signals it; each checks what its predecessor put. Last,
// every rank abandons a window and its allocation (what shrink mode does
// when a peer is lost), sees the next window refused for the rest of the
// process, and exits with NVSHMEM never finalized. Exit status 0 when every
// rank passed.
//
//   turnout_nvshmem_smoke [num_ranks] [port] [timeout_s]
//
// Ranks that share a GPU need MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
// summing to at most 100 per GPU for NVSHMEM's full support; the caller sets
// it (tests/gpu/test_nvshmem_window.py does).

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fork_ranks.hpp"
#include "runtime/cuda_resources.hpp"
#include "runtime/nvshmem_loader.hpp"
#include "runtime/nvshmem_window.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/error.hpp"

namespace {

#define EXPECT(cond, ...)                                               \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "rank %d: check failed: %s: ", rank, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                \
      std::fprintf(stderr, "\n");                                       \
      return 1;                                                         \
    }                                                                   \
  } while (0)

// NVSHMEM's NVSHMEM_STATUS_* values (nvshmem_constants.h); the core includes
// no NVSHMEM header.
const char* describe_init_status(int status) {
  switch (status) {
    case 2:
      return "initialized, one PE per GPU";
    case 3:
      return "limited support for PEs sharing a GPU (no MPS, or MPS percentages summing to more than 100)";
    case 4:
      return "full support for PEs sharing a GPU (MPS)";
    default:
      return "unexpected";
  }
}

int check_window(turnout::Bootstrap& bootstrap, int rank, int num_ranks, int round) {
  turnout::NvshmemWindow window(bootstrap);
  EXPECT(window.rank() == rank, "round %d: NVSHMEM's PE is %d", round, window.rank());
  EXPECT(window.size() == num_ranks, "round %d: NVSHMEM has %d PEs", round, window.size());
  const int status = window.init_status();
  if (rank == 0) std::printf("round %d: NVSHMEM init status %d: %s\n", round, status, describe_init_status(status));

  // Every rank refuses alike (collectively), so the bootstrap stays in step.
  bool refused = false;
  try {
    turnout::NvshmemWindow second(bootstrap);
  } catch (const turnout::NotSupported& e) {
    refused = std::strstr(e.what(), "already open") != nullptr;
    if (!refused) std::fprintf(stderr, "rank %d: the second window's error: %s\n", rank, e.what());
  }
  EXPECT(refused, "round %d: a second window while one is open was not refused as already open", round);

  turnout::NvshmemAllocation value = window.alloc(sizeof(int));
  turnout::NvshmemAllocation signal = window.alloc(sizeof(uint64_t));
  EXPECT(value.get() != nullptr && signal.get() != nullptr, "round %d: alloc returned null", round);
  EXPECT(window.peer_ptr(value.get(), rank) == value.get(), "round %d: peer_ptr of its own PE is not its address",
         round);
  int reachable = 0;
  for (int pe = 0; pe < num_ranks; ++pe) reachable += window.peer_ptr(value.get(), pe) != nullptr;
  std::printf("rank %d: round %d: load/store reaches %d of %d PEs\n", rank, round, reachable, num_ranks);

  turnout::Stream stream = turnout::create_comm_stream();
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(value.get(), 0xff, sizeof(int), stream.get()));
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(signal.get(), 0, sizeof(uint64_t), stream.get()));
  // No peer's put or signal may land before this rank's zeroing.
  window.barrier(stream.get());
  const turnout::NvshmemApi& api = turnout::nvshmem_api();
  turnout::nvshmem_check(
      api, api.ring_test(static_cast<int*>(value.get()), static_cast<uint64_t*>(signal.get()), stream.get()),
      "ring_test");
  TURNOUT_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  int got = 0;
  TURNOUT_CUDA_CHECK(cudaMemcpy(&got, value.get(), sizeof got, cudaMemcpyDeviceToHost));
  const int from = (rank + num_ranks - 1) % num_ranks;
  EXPECT(got == from + 1000, "round %d: the value from PE %d is %d, expected %d", round, from, got, from + 1000);
  // The allocations go before the window, collectively (nvshmem_free).
  window.barrier(stream.get());
  TURNOUT_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  return 0;
}

// No NVSHMEM call: abandoning is not collective. The refusal after it is
// all-gathered, so every rank refuses alike.
int check_abandon(turnout::Bootstrap& bootstrap, int rank) {
  {
    turnout::NvshmemWindow window(bootstrap);
    turnout::NvshmemAllocation memory = window.alloc(4096);
    memory.abandon();
    EXPECT(memory.get() == nullptr, "an abandoned allocation still holds its pointer");
    window.abandon();
  }
  bool refused = false;
  try {
    turnout::NvshmemWindow again(bootstrap);
  } catch (const turnout::NotSupported& e) {
    refused = std::strstr(e.what(), "new process") != nullptr;
    if (!refused) std::fprintf(stderr, "rank %d: the window after abandon: %s\n", rank, e.what());
  }
  EXPECT(refused, "a window after an abandoned one was not refused for the rest of the process");
  return 0;
}

int run_rank(int rank, int num_ranks, uint16_t port) {
  try {
    int devices = 0;
    TURNOUT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    TURNOUT_CUDA_CHECK(cudaSetDevice(rank % devices));
    turnout::TcpBootstrap bootstrap(rank, num_ranks, "127.0.0.1", port, std::chrono::seconds(60));
    for (int round = 0; round < 2; ++round)
      if (check_window(bootstrap, rank, num_ranks, round)) return 1;
    if (check_abandon(bootstrap, rank)) return 1;
    std::printf("rank %d: ok\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int num_ranks = 0;
  if (argc > 1) {
    num_ranks = std::atoi(argv[1]);
  } else if (cudaGetDeviceCount(&num_ranks) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const uint16_t port = argc > 2 ? static_cast<uint16_t>(std::atoi(argv[2])) : 29612;
  const int timeout_s = argc > 3 ? std::atoi(argv[3]) : 120;
  if (num_ranks < 1 || timeout_s < 1) return 1;
  return turnout::fork_ranks::run(num_ranks, timeout_s, [&](int r) { return run_rank(r, num_ranks, port); });
}
