// File descriptor passing over Unix sockets (runtime/fd_passing.hpp). Ranks
// are threads that all-gather their addresses through a barrier, or forked
// processes that use a TcpBootstrap; each gives the others a memfd holding a
// value only it wrote, and reads the value back through the peers' fds.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/fd_passing.hpp"
#include "thread_ranks.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

using turnout::thread_ranks::expect_no_errors;
using turnout::thread_ranks::message_of;
using turnout::thread_ranks::run_ranks;

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

int64_t value_of(int rank) {
  return 1000 + 7 * rank;
}

// A memfd holding value_of(rank) at offset 0.
UniqueFd memfd_with_value(int rank) {
  UniqueFd fd(memfd_create("turnout-fd-test", MFD_CLOEXEC));
  if (!fd) throw std::runtime_error("memfd_create failed");
  const int64_t v = value_of(rank);
  if (pwrite(fd.get(), &v, sizeof v, 0) != static_cast<ssize_t>(sizeof v))
    throw std::runtime_error("pwrite to the memfd failed");
  return fd;
}

int64_t read_value(int fd) {
  int64_t v = -1;
  if (pread(fd, &v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) return -1;
  return v;
}

std::vector<FdPeer> peers_of(int rank, const std::vector<FdAddress>& addresses) {
  std::vector<FdPeer> peers;
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r)
    if (r != rank) peers.push_back({r, addresses[r]});
  return peers;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool close_on_exec(int fd) {
  const int flags = fcntl(fd, F_GETFD);
  return flags >= 0 && (flags & FD_CLOEXEC) != 0;
}

TEST(FdExchangeTest, ThreadsReadEveryPeersValue) {
  constexpr int kSize = 4;
  std::vector<FdAddress> addresses(kSize);
  std::barrier gathered(kSize);
  const auto errors = run_ranks(kSize, [&](int rank) {
    const UniqueFd mine = memfd_with_value(rank);
    FdExchange exchange(rank);
    addresses[static_cast<size_t>(rank)] = exchange.address();
    gathered.arrive_and_wait();
    const auto peers = peers_of(rank, addresses);
    const std::vector<UniqueFd> got = exchange.exchange(mine.get(), peers, 10s);
    ASSERT_EQ(got.size(), peers.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NE(got[i].get(), mine.get());
      EXPECT_TRUE(close_on_exec(got[i].get())) << "rank " << rank << " from rank " << peers[i].rank;
      EXPECT_EQ(read_value(got[i].get()), value_of(peers[i].rank)) << "rank " << rank << " from " << peers[i].rank;
    }
    // One exchange per object: a second has no round to tell it apart.
    EXPECT_THROW(exchange.exchange(mine.get(), peers, 1s), Error);
  });
  expect_no_errors(errors);
}

TEST(FdExchangeTest, SignalsDoNotBreakWaits) {
  constexpr int kSize = 3;
  std::vector<FdAddress> addresses(kSize);
  std::barrier gathered(kSize);
  const auto errors = thread_ranks::run_ranks_under_signals(kSize, [&](int r) {
    const UniqueFd mine = memfd_with_value(r);
    FdExchange exchange(r);
    addresses[static_cast<size_t>(r)] = exchange.address();
    gathered.arrive_and_wait();
    // The others wait in poll() for the last rank meanwhile: 100 signals a rank.
    if (r == kSize - 1) thread_ranks::wait_for_signals(100 * kSize, 10s);
    const auto peers = peers_of(r, addresses);
    const auto got = exchange.exchange(mine.get(), peers, 10s);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(read_value(got[i].get()), value_of(peers[i].rank));
  });
  expect_no_errors(errors);
  EXPECT_GE(thread_ranks::signals_handled.load(), 100 * kSize);
}

TEST(FdExchangeTest, AddressesDifferAndNameTheRank) {
  FdExchange a(3), b(3);
  const std::string name_a(a.address().name.data()), name_b(b.address().name.data());
  EXPECT_NE(name_a, name_b);
  EXPECT_NE(a.address().key, b.address().key);
  EXPECT_NE(name_a.find("/3/"), std::string::npos) << name_a;
  EXPECT_NE(name_a.find(std::to_string(getpid())), std::string::npos) << name_a;
}

TEST(FdExchangeTest, NoPeersIsImmediate) {
  FdExchange exchange(0);
  const UniqueFd mine = memfd_with_value(0);
  EXPECT_TRUE(exchange.exchange(mine.get(), {}, 1ms).empty());
}

TEST(FdExchangeTest, BadArgumentsAreRejected) {
  FdExchange exchange(1);
  const UniqueFd mine = memfd_with_value(1);
  const std::vector<FdPeer> self{{1, exchange.address()}};
  EXPECT_THROW(exchange.exchange(mine.get(), self, 1s), InvalidArgument);
  FdExchange other(2);
  const std::vector<FdPeer> twice{{2, other.address()}, {2, other.address()}};
  EXPECT_THROW(exchange.exchange(mine.get(), twice, 1s), InvalidArgument);
  const std::vector<FdPeer> one{{2, other.address()}};
  EXPECT_THROW(exchange.exchange(-1, one, 1s), InvalidArgument);
  // Rejected arguments leave the exchange usable.
  EXPECT_TRUE(exchange.exchange(mine.get(), {}, 1ms).empty());
}

// Rank 2 listens (its address was gathered) but never exchanges: the others
// give up at the deadline and name it.
TEST(FdExchangeTest, PeerThatNeverComesTimesOutNamingIt) {
  constexpr int kSize = 3;
  std::vector<FdAddress> addresses(kSize);
  std::barrier gathered(kSize), done(kSize);
  std::vector<double> elapsed(kSize);
  const auto errors = run_ranks(kSize, [&](int rank) {
    const UniqueFd mine = memfd_with_value(rank);
    FdExchange exchange(rank);
    addresses[static_cast<size_t>(rank)] = exchange.address();
    gathered.arrive_and_wait();
    if (rank == 2) {
      done.arrive_and_wait();
      return;
    }
    const auto start = Clock::now();
    try {
      exchange.exchange(mine.get(), peers_of(rank, addresses), 500ms);
    } catch (...) {
      elapsed[static_cast<size_t>(rank)] = seconds_since(start);
      done.arrive_and_wait();
      throw;
    }
    done.arrive_and_wait();
  });
  EXPECT_FALSE(errors[2]);
  for (int r = 0; r < 2; ++r) {
    const std::string what = message_of<TimeoutError>(errors[static_cast<size_t>(r)], r);
    EXPECT_NE(what.find("rank 2"), std::string::npos) << what;
    EXPECT_NE(what.find("500 ms"), std::string::npos) << what;
    EXPECT_NE(what.find("rank " + std::to_string(r) + ":"), std::string::npos) << what;
    EXPECT_GE(elapsed[static_cast<size_t>(r)], 0.45);
    EXPECT_LT(elapsed[static_cast<size_t>(r)], 1.5);
  }
}

// A peer whose listener is gone (its process died) is not waited for.
TEST(FdExchangeTest, PeerThatIsGoneFailsAtOnce) {
  FdAddress gone;
  {
    FdExchange peer(1);
    gone = peer.address();
  }
  FdExchange exchange(0);
  const UniqueFd mine = memfd_with_value(0);
  const std::vector<FdPeer> peers{{1, gone}};
  const auto start = Clock::now();
  try {
    exchange.exchange(mine.get(), peers, 5s);
    ADD_FAILURE() << "no error for a peer that is gone";
  } catch (const TimeoutError& e) {
    ADD_FAILURE() << "waited for a peer that is gone: " << e.what();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 1.0);
}

// Anything on the host may connect to the socket. A silent connection, junk,
// and a client with the wrong key (claiming a real rank) get nothing, and
// the real peers are still served.
TEST(FdExchangeTest, StrangersGetNothing) {
  std::vector<FdAddress> addresses(2);
  FdExchange exchange0(0), exchange1(1);
  addresses[0] = exchange0.address();
  addresses[1] = exchange1.address();
  const UniqueFd fd0 = memfd_with_value(0), fd1 = memfd_with_value(1);

  std::exception_ptr error0;
  std::vector<UniqueFd> got0;
  std::thread rank0([&] {
    try {
      got0 = exchange0.exchange(fd0.get(), peers_of(0, addresses), 10s);
    } catch (...) {
      error0 = std::current_exception();
    }
  });

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name(addresses[0].name.data());
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  const UniqueFd silent(socket(AF_UNIX, SOCK_STREAM, 0));
  ASSERT_EQ(connect(silent.get(), reinterpret_cast<const sockaddr*>(&addr), len), 0);
  {
    const UniqueFd junk(socket(AF_UNIX, SOCK_STREAM, 0));
    ASSERT_EQ(connect(junk.get(), reinterpret_cast<const sockaddr*>(&addr), len), 0);
    const char text[] = "GET / HTTP/1.0\r\n\r\n";
    ASSERT_EQ(send(junk.get(), text, sizeof text, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof text));
  }
  {
    FdExchange impostor(1);
    std::vector<FdPeer> wrong_key{{0, addresses[0]}};
    wrong_key[0].address.key ^= 1;
    const UniqueFd fake = memfd_with_value(9);
    try {
      impostor.exchange(fake.get(), wrong_key, 2s);
      ADD_FAILURE() << "a wrong key got rank 0's descriptor";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "a wrong key was left waiting instead of turned away: " << e.what();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 closed the connection"), std::string::npos) << e.what();
    }
  }

  std::vector<UniqueFd> got1;
  EXPECT_NO_THROW(got1 = exchange1.exchange(fd1.get(), peers_of(1, addresses), 10s));
  rank0.join();
  expect_no_errors({error0});
  ASSERT_EQ(got0.size(), 1u);
  ASSERT_EQ(got1.size(), 1u);
  EXPECT_EQ(read_value(got0[0].get()), value_of(1));
  EXPECT_EQ(read_value(got1[0].get()), value_of(0));
}

// Asks the kernel for a free port (nothing connects to the probe).
uint16_t free_port() {
  const UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  EXPECT_EQ(getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  return ntohs(addr.sin_port);
}

// One rank in a forked process: 0 when it read every peer's value. The last
// rank exits as soon as it has its peers' descriptors: what it gave stays
// readable without it.
int process_rank(int rank, int size, uint16_t port) {
  try {
    TcpBootstrap bootstrap(rank, size, "127.0.0.1", port, 10s);
    const UniqueFd mine = memfd_with_value(rank);
    FdExchange exchange(rank);
    const FdAddress address = exchange.address();
    const auto gathered = bootstrap.all_gather(std::as_bytes(std::span(&address, 1)));
    std::vector<FdAddress> addresses(static_cast<size_t>(size));
    std::memcpy(addresses.data(), gathered.data(), gathered.size());
    const auto peers = peers_of(rank, addresses);
    const std::vector<UniqueFd> got = exchange.exchange(mine.get(), peers, 10s);
    if (rank == size - 1) return got.size() == peers.size() ? 0 : 1;
    for (size_t i = 0; i < got.size(); ++i)
      if (read_value(got[i].get()) != value_of(peers[i].rank)) {
        std::fprintf(stderr, "rank %d read %lld from rank %d\n", rank, static_cast<long long>(read_value(got[i].get())),
                     peers[i].rank);
        return 1;
      }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 2;
  }
}

TEST(FdExchangeTest, ProcessesReadEveryPeersValue) {
  constexpr int kSize = 3;
  const uint16_t port = free_port();
  std::vector<pid_t> children;
  for (int r = 0; r < kSize; ++r) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) _exit(process_rank(r, kSize, port));
    children.push_back(pid);
  }
  for (int r = 0; r < kSize; ++r) {
    int status = 0;
    ASSERT_EQ(waitpid(children[static_cast<size_t>(r)], &status, 0), children[static_cast<size_t>(r)]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " status " << status;
  }
}

}  // namespace
}  // namespace turnout
