// Bootstrap tests over loopback. Each rank is a TcpBootstrap object on its own
// thread; every test uses a fresh port so tests cannot disturb each other.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "thread_ranks.hpp"
#include "turnout/bootstrap.hpp"
#include "turnout/error.hpp"

namespace {

using turnout::thread_ranks::expect_no_errors;
using turnout::thread_ranks::message_of;
using turnout::thread_ranks::run_ranks;

using turnout::TcpBootstrap;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Asks the kernel for a free port. Nothing connects to the probe, so the port
// is free again at once (no TIME_WAIT).
uint16_t free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t len = sizeof addr;
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

std::vector<std::byte> payload(int rank, size_t n, int round) {
  std::vector<std::byte> bytes(n);
  for (size_t i = 0; i < n; ++i)
    bytes[i] = static_cast<std::byte>((rank * 131 + static_cast<int>(i) * 7 + round * 13) & 0xff);
  return bytes;
}

std::vector<std::byte> expected_gather(int size, size_t n, int round) {
  std::vector<std::byte> all;
  for (int r = 0; r < size; ++r) {
    const auto part = payload(r, n, round);
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(TcpBootstrapTest, AllGatherOfManySizesRepeated) {
  constexpr int kSize = 4;
  const uint16_t port = free_port();
  const auto errors = run_ranks(kSize, [&](int rank) {
    TcpBootstrap boot(rank, kSize, "127.0.0.1", port, 20s);
    ASSERT_EQ(boot.rank(), rank);
    ASSERT_EQ(boot.size(), kSize);
    int round = 0;
    for (int repeat = 0; repeat < 3; ++repeat)
      for (size_t n : {size_t{1}, size_t{1000}, size_t{1} << 20, size_t{0}}) {
        const auto got = boot.all_gather(payload(rank, n, round));
        EXPECT_TRUE(got == expected_gather(kSize, n, round)) << "rank " << rank << " n " << n << " round " << round;
        ++round;
      }
  });
  expect_no_errors(errors);
}

TEST(TcpBootstrapTest, LocalhostByName) {
  const uint16_t port = free_port();
  const auto errors = run_ranks(2, [&](int rank) {
    TcpBootstrap boot(rank, 2, "localhost", port, 10s);
    EXPECT_TRUE(boot.all_gather(payload(rank, 5, 0)) == expected_gather(2, 5, 0));
  });
  expect_no_errors(errors);
}

TEST(TcpBootstrapTest, RootStartingLateIsWaitedFor) {
  const uint16_t port = free_port();
  const auto errors = run_ranks(3, [&](int rank) {
    if (rank == 0) std::this_thread::sleep_for(500ms);
    TcpBootstrap boot(rank, 3, "127.0.0.1", port, 10s);
    EXPECT_TRUE(boot.all_gather(payload(rank, 3, 1)) == expected_gather(3, 3, 1));
  });
  expect_no_errors(errors);
}

TEST(TcpBootstrapTest, BarrierWaitsForTheLastRank) {
  constexpr int kSize = 3;
  const uint16_t port = free_port();
  std::vector<double> waited(kSize);
  const auto errors = run_ranks(kSize, [&](int rank) {
    TcpBootstrap boot(rank, kSize, "127.0.0.1", port, 10s);
    boot.barrier();
    if (rank == 2) std::this_thread::sleep_for(400ms);
    const auto start = Clock::now();
    boot.barrier();
    waited[static_cast<size_t>(rank)] = seconds_since(start);
    for (int i = 0; i < 5; ++i) boot.barrier();
  });
  expect_no_errors(errors);
  EXPECT_GT(waited[0], 0.3);
  EXPECT_GT(waited[1], 0.3);
}

TEST(TcpBootstrapTest, SignalsDoNotBreakWaits) {
  constexpr int kSize = 3;
  const uint16_t port = free_port();
  const auto errors = turnout::thread_ranks::run_ranks_under_signals(kSize, [&](int r) {
    // The others wait in connect meanwhile: 100 signals a rank.
    if (r == 0) turnout::thread_ranks::wait_for_signals(100 * kSize, 10s);
    TcpBootstrap boot(r, kSize, "127.0.0.1", port, 20s);
    for (int round = 0; round < 4; ++round) {
      // The others now sit in poll() waiting for rank 2.
      if (r == 2) std::this_thread::sleep_for(50ms);
      EXPECT_TRUE(boot.all_gather(payload(r, 1 << 20, round)) == expected_gather(kSize, 1 << 20, round));
    }
  });
  expect_no_errors(errors);
  EXPECT_GE(turnout::thread_ranks::signals_handled.load(), 100 * kSize);
}

TEST(TcpBootstrapTest, SizeOneNeedsNoSockets) {
  // The port is taken; a size-1 bootstrap must not try to bind it.
  const int blocker = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(blocker, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(blocker, 1), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(getsockname(blocker, reinterpret_cast<sockaddr*>(&addr), &len), 0);

  TcpBootstrap boot(0, 1, "127.0.0.1", ntohs(addr.sin_port), 1s);
  const auto mine = payload(0, 77, 0);
  EXPECT_TRUE(boot.all_gather(mine) == mine);
  EXPECT_TRUE(boot.all_gather({}).empty());
  boot.barrier();
  close(blocker);
}

TEST(TcpBootstrapTest, MismatchedLengthsFailOnEveryRankWithoutHanging) {
  constexpr int kSize = 3;
  const uint16_t port = free_port();
  const auto start = Clock::now();
  std::vector<std::exception_ptr> later(kSize);
  const auto errors = run_ranks(kSize, [&](int rank) {
    TcpBootstrap boot(rank, kSize, "127.0.0.1", port, 2s);
    boot.all_gather(payload(rank, 16, 0));  // a good round first
    try {
      boot.all_gather(payload(rank, rank == 1 ? 8 : 4, 1));
    } catch (...) {
      // Once broken, the bootstrap must refuse further use rather than hang.
      try {
        boot.all_gather(payload(rank, 4, 2));
      } catch (...) {
        later[static_cast<size_t>(rank)] = std::current_exception();
      }
      throw;
    }
  });
  EXPECT_LT(seconds_since(start), 2.0);
  for (int r = 0; r < kSize; ++r) {
    const std::string what = message_of<turnout::Error>(errors[static_cast<size_t>(r)], r);
    EXPECT_NE(what.find("rank 1 passed 8 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 0 passed 4"), std::string::npos) << what;
    EXPECT_EQ(what.find("timed out"), std::string::npos) << what;
    EXPECT_NE(message_of<turnout::Error>(later[static_cast<size_t>(r)], r).find("unusable"), std::string::npos);
  }
}

TEST(TcpBootstrapTest, RootThatNeverComesTimesOutInConnect) {
  const uint16_t port = free_port();
  const auto start = Clock::now();
  std::exception_ptr error;
  try {
    TcpBootstrap boot(1, 2, "127.0.0.1", port, 1s);
  } catch (...) {
    error = std::current_exception();
  }
  const double elapsed = seconds_since(start);
  const std::string what = message_of<turnout::TimeoutError>(error, 1);
  EXPECT_NE(what.find("connect"), std::string::npos) << what;
  EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
  EXPECT_GE(elapsed, 0.9);
  EXPECT_LT(elapsed, 2.0);
}

TEST(TcpBootstrapTest, RankThatNeverConnectsIsNamedByTheRoot) {
  constexpr int kSize = 4;
  const uint16_t port = free_port();
  const auto start = Clock::now();
  // Ranks 0, 1 and 3 come; rank 2 never does.
  const auto errors = run_ranks(kSize, [&](int rank) {
    if (rank != 2) TcpBootstrap boot(rank, kSize, "127.0.0.1", port, 1s);
  });
  EXPECT_LT(seconds_since(start), 2.0);
  const std::string what = message_of<turnout::TimeoutError>(errors[0], 0);
  EXPECT_NE(what.find("accept"), std::string::npos) << what;
  EXPECT_NE(what.find("not heard from rank 2"), std::string::npos) << what;
  message_of<turnout::TimeoutError>(errors[1], 1);
  message_of<turnout::TimeoutError>(errors[3], 3);
}

TEST(TcpBootstrapTest, RanksSilentInAllGatherAreAllNamed) {
  constexpr int kSize = 4;
  const uint16_t port = free_port();
  double root_elapsed = 0;
  const auto errors = run_ranks(kSize, [&](int rank) {
    TcpBootstrap boot(rank, kSize, "127.0.0.1", port, 1s);
    boot.barrier();
    if (rank == 1 || rank == 3) {
      // Stay connected but never join: the root must not wait forever.
      std::this_thread::sleep_for(1500ms);
      return;
    }
    const auto start = Clock::now();
    try {
      boot.all_gather(payload(rank, 10, 0));
    } catch (...) {
      if (rank == 0) root_elapsed = seconds_since(start);
      throw;
    }
  });
  EXPECT_LT(root_elapsed, 2.0);
  const std::string what = message_of<turnout::TimeoutError>(errors[0], 0);
  EXPECT_NE(what.find("all_gather"), std::string::npos) << what;
  EXPECT_NE(what.find("not heard from ranks 1, 3"), std::string::npos) << what;
  message_of<turnout::TimeoutError>(errors[2], 2);
}

TEST(TcpBootstrapTest, SizeMismatchIsRejected) {
  const uint16_t port = free_port();
  const auto start = Clock::now();
  const auto errors =
      run_ranks(2, [&](int rank) { TcpBootstrap boot(rank, rank == 0 ? 2 : 3, "127.0.0.1", port, 5s); });
  EXPECT_LT(seconds_since(start), 5.0);
  for (int r = 0; r < 2; ++r) {
    const std::string what = message_of<turnout::Error>(errors[static_cast<size_t>(r)], r);
    EXPECT_NE(what.find("size 3"), std::string::npos) << what;
  }
}

TEST(TcpBootstrapTest, DuplicateRankIsRejected) {
  const uint16_t port = free_port();
  const auto start = Clock::now();
  // Two processes both think they are rank 1 of 3.
  const auto errors =
      run_ranks(3, [&](int thread) { TcpBootstrap boot(thread == 0 ? 0 : 1, 3, "127.0.0.1", port, 5s); });
  EXPECT_LT(seconds_since(start), 5.0);
  for (int r = 0; r < 3; ++r) {
    const std::string what = message_of<turnout::Error>(errors[static_cast<size_t>(r)], r);
    EXPECT_NE(what.find("duplicate rank"), std::string::npos) << what;
  }
}

TEST(TcpBootstrapTest, StrangerConnectionsAreIgnored) {
  const uint16_t port = free_port();
  const auto errors = run_ranks(2, [&](int rank) {
    if (rank == 1) {
      // Something else knocks on the port first: garbage, then hang up.
      std::this_thread::sleep_for(200ms);
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(port);
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
      const char junk[] = "GET / HTTP/1.0\r\n\r\n";
      ASSERT_EQ(send(fd, junk, sizeof junk, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof junk));
      close(fd);
    }
    TcpBootstrap boot(rank, 2, "127.0.0.1", port, 5s);
    EXPECT_TRUE(boot.all_gather(payload(rank, 9, 0)) == expected_gather(2, 9, 0));
  });
  expect_no_errors(errors);
}

TEST(TcpBootstrapTest, InvalidArgumentsNameTheArgument) {
  const auto expect_invalid = [](const std::function<void()>& make, const std::string& name) {
    try {
      make();
      ADD_FAILURE() << "no exception for bad " << name;
    } catch (const turnout::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  expect_invalid([] { TcpBootstrap(-1, 2, "127.0.0.1", 29500); }, "rank");
  expect_invalid([] { TcpBootstrap(2, 2, "127.0.0.1", 29500); }, "rank");
  expect_invalid([] { TcpBootstrap(0, 0, "127.0.0.1", 29500); }, "size");
  expect_invalid([] { TcpBootstrap(0, 2, "127.0.0.1", 0); }, "port");
  expect_invalid([] { TcpBootstrap(0, 2, "", 29500); }, "root_host");
  expect_invalid([] { TcpBootstrap(0, 2, "127.0.0.1", 29500, 0ms); }, "timeout");
  expect_invalid([] { turnout::FunctionBootstrap(3, 3, [](auto) { return std::vector<std::byte>{}; }); }, "rank");
  expect_invalid([] { turnout::FunctionBootstrap(0, 0, [](auto) { return std::vector<std::byte>{}; }); }, "size");
  expect_invalid([] { turnout::FunctionBootstrap(0, 1, nullptr); }, "all_gather");
}

TEST(FunctionBootstrapTest, CallsTheFunctionAndChecksItsResult) {
  int calls = 0;
  size_t answer_extra = 0;
  // Pretends to be rank 1 of 3 whose peers sent payload(r, ...).
  turnout::FunctionBootstrap boot(1, 3, [&](std::span<const std::byte> mine) {
    ++calls;
    auto all = expected_gather(3, mine.size(), 0);
    std::copy(mine.begin(), mine.end(), all.begin() + static_cast<long>(mine.size()));
    all.resize(all.size() + answer_extra);
    return all;
  });
  EXPECT_EQ(boot.rank(), 1);
  EXPECT_EQ(boot.size(), 3);
  EXPECT_TRUE(boot.all_gather(payload(1, 6, 0)) == expected_gather(3, 6, 0));
  boot.barrier();
  EXPECT_EQ(calls, 2);

  answer_extra = 1;
  try {
    boot.all_gather(payload(1, 6, 0));
    ADD_FAILURE() << "a wrong-sized answer was accepted";
  } catch (const turnout::Error& e) {
    EXPECT_NE(std::string(e.what()).find("returned 19 bytes, expected 18"), std::string::npos) << e.what();
  }
}

}  // namespace
