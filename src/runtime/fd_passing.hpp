// Passes file descriptors between the processes of one host. A descriptor is
// a number only its own process can use, and the Bootstrap moves only bytes,
// so each rank listens on an abstract Unix domain socket and hands its
// descriptor to every peer that connects (SCM_RIGHTS makes the kernel
// install it in the receiver). Linux only: abstract socket names need no
// file on disk and vanish when the listener closes, even on SIGKILL.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "runtime/unique_fd.hpp"

namespace turnout {

// Where an FdExchange listens and the key a peer must present there. Fixed
// size and plain bytes, so it can travel inside an all-gathered struct.
struct FdAddress {
  std::array<char, 64> name{};  // the abstract socket's name, NUL-padded
  // Random and told only to the job (through the all-gather): any process on
  // the host may connect to the socket, and the descriptor grants access to
  // this rank's memory.
  uint64_t key = 0;
};
static_assert(std::is_trivially_copyable_v<FdAddress>);

struct FdPeer {
  int rank;  // global rank: what this rank is called in errors
  FdAddress address;
};

class FdExchange {
 public:
  // Listens at once, so that peers may connect as soon as they learn
  // address(), which therefore must be created before it is all-gathered.
  // The name holds the pid, a per-process count and a random number, so
  // concurrent jobs and Buffers never meet.
  explicit FdExchange(int rank);
  FdExchange(const FdExchange&) = delete;
  FdExchange& operator=(const FdExchange&) = delete;

  const FdAddress& address() const { return address_; }

  // Gives `fd` to every peer in `peers` and returns each peer's descriptor in
  // the same order. Collective: every peer calls it with this rank among its
  // own peers. A server thread answers the peers' connections while this
  // thread fetches theirs; it is joined before this returns or throws. All
  // of it ends within `timeout`: TimeoutError names a peer that did not
  // answer or never came; Error names a peer that was not listening. Once
  // per object (a hello carries no round): the listener closes at the end.
  std::vector<UniqueFd> exchange(int fd, std::span<const FdPeer> peers, std::chrono::milliseconds timeout);

 private:
  int rank_;
  FdAddress address_;
  UniqueFd listener_;
};

}  // namespace turnout
