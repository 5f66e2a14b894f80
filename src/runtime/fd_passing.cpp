// Wire format (native byte order: both ends are on one host):
//   hello  client -> server  u32 magic, i32 the client's rank, u64 the server's key
//   reply  server -> client  one byte carrying the descriptor (SCM_RIGHTS)
// A connection without a valid hello (a stranger, a wrong key, a rank already
// served) is closed without a reply. Every socket is non-blocking and every
// wait is a poll() with the time left, so nothing outlives the deadline.
#include "runtime/fd_passing.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <system_error>
#include <thread>

#include "runtime/socket_wait.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

using net::Clock;
using net::deadline_after;
using net::errno_text;
using net::ms_left;
using net::ranks_text;
using net::wait_fd;
using std::chrono::milliseconds;

constexpr uint32_t kMagic = 0x54464431;  // "TFD1": bump the digit when the wire format changes
constexpr char kReplyByte = 'F';

struct Hello {
  uint32_t magic;
  int32_t rank;
  uint64_t key;
};

// What every error needs: who we are and how long we waited.
struct Ctx {
  int rank;
  milliseconds timeout;
  Clock::time_point deadline;
};

std::string who(int rank) {
  return "FdExchange rank " + std::to_string(rank) + ": ";
}

std::string name_of(const FdAddress& address) {
  return std::string(address.name.data(), strnlen(address.name.data(), address.name.size()));
}

UniqueFd unix_socket(int rank) {
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) throw Error(who(rank) + "cannot create a Unix socket: " + errno_text(errno));
  return fd;
}

// An abstract name starts with a NUL byte and is exactly `len` bytes long.
socklen_t abstract_address(const FdAddress& address, sockaddr_un& addr) {
  const std::string name = name_of(address);
  static_assert(sizeof(FdAddress::name) < sizeof(sockaddr_un::sun_path));
  addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

uint64_t random_u64(std::random_device& rd) {
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// Sends the reply: one byte carrying `fd`. 0 or an errno.
int send_fd(int sock, int fd, Clock::time_point deadline) {
  char byte = kReplyByte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  for (;;) {
    if (sendmsg(sock, &msg, MSG_NOSIGNAL) == 1) return 0;
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK) return err;
    if (const int rc = wait_fd(sock, POLLOUT, deadline); rc != 0) return rc;
  }
}

// The server side: a connection being read until its hello is complete.
struct Visitor {
  UniqueFd fd;
  Hello hello{};
  size_t got = 0;
};

// Answers connections until every rank in `waiting` has fetched `fd`, or
// `stop` becomes readable.
void serve(const Ctx& c, int listener, int stop, int fd, uint64_t key, std::vector<int> waiting) {
  std::vector<Visitor> visitors;
  std::vector<pollfd> polls;
  while (!waiting.empty()) {
    polls.assign({{stop, POLLIN, 0}, {listener, POLLIN, 0}});
    for (const Visitor& v : visitors) polls.push_back({v.fd.get(), POLLIN, 0});
    const int rc = poll(polls.data(), polls.size(), ms_left(c.deadline));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw Error(who(c.rank) + "poll failed while serving its file descriptor: " + errno_text(errno));
    }
    if (rc == 0) {
      if (Clock::now() < c.deadline) continue;
      throw TimeoutError(who(c.rank) + "timed out after " + std::to_string(c.timeout.count()) +
                         " ms: " + ranks_text(waiting) + " never came for this rank's file descriptor");
    }
    if (polls[0].revents != 0) return;

    std::vector<Visitor> still;
    for (size_t i = 0; i < visitors.size(); ++i) {
      Visitor& v = visitors[i];
      if (polls[i + 2].revents == 0) {
        still.push_back(std::move(v));
        continue;
      }
      const ssize_t n = recv(v.fd.get(), reinterpret_cast<char*>(&v.hello) + v.got, sizeof(Hello) - v.got, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
        still.push_back(std::move(v));
        continue;
      }
      if (n <= 0) continue;  // hung up or broke before a whole hello: forget it
      v.got += static_cast<size_t>(n);
      if (v.got < sizeof(Hello)) {
        still.push_back(std::move(v));
        continue;
      }
      const auto it = std::find(waiting.begin(), waiting.end(), v.hello.rank);
      if (v.hello.magic != kMagic || v.hello.key != key || it == waiting.end()) continue;
      // A peer that hangs up before the reply is not served; it will not
      // come back, so the deadline names it.
      if (send_fd(v.fd.get(), fd, c.deadline) == 0) waiting.erase(it);
    }
    visitors.swap(still);

    if (polls[1].revents != 0)
      for (;;) {
        UniqueFd conn(accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (conn) {
          visitors.push_back({std::move(conn)});
          continue;
        }
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) break;
        // The connection died in the backlog, or a signal came: try the next one.
        if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
        throw Error(who(c.rank) + "accept failed: " + errno_text(err));
      }
  }
}

// A wait_fd() failure while talking to `peer`.
[[noreturn]] void throw_wait(const Ctx& c, int rc, const char* step, const FdPeer& peer) {
  const std::string what = std::string(step) + " rank " + std::to_string(peer.rank);
  if (rc == net::kTimedOut)
    throw TimeoutError(who(c.rank) + "timed out after " + std::to_string(c.timeout.count()) + " ms " + what);
  throw Error(who(c.rank) + "poll failed " + what + ": " + errno_text(rc));
}

void connect_to(const Ctx& c, int sock, const FdPeer& peer) {
  sockaddr_un addr;
  const socklen_t len = abstract_address(peer.address, addr);
  for (;;) {
    if (connect(sock, reinterpret_cast<const sockaddr*>(&addr), len) == 0) return;
    const int err = errno;
    if (err == EISCONN) return;
    // EAGAIN: the peer's backlog is full; it drains as the peer accepts.
    if (err == EAGAIN || err == EINTR) {
      if (Clock::now() >= c.deadline)
        throw TimeoutError(who(c.rank) + "timed out after " + std::to_string(c.timeout.count()) +
                           " ms connecting to rank " + std::to_string(peer.rank));
      std::this_thread::sleep_for(milliseconds(1));
      continue;
    }
    // The listener exists before its address is all-gathered, so no answer
    // now means none later.
    throw Error(who(c.rank) + "cannot connect to rank " + std::to_string(peer.rank) + " at the abstract socket '" +
                name_of(peer.address) + "': " + errno_text(err) +
                (err == ECONNREFUSED ? " (it is gone, or in another network namespace)" : ""));
  }
}

void send_hello(const Ctx& c, int sock, const FdPeer& peer) {
  const Hello hello{kMagic, c.rank, peer.address.key};
  const auto* p = reinterpret_cast<const char*>(&hello);
  size_t sent = 0;
  while (sent < sizeof hello) {
    const ssize_t n = send(sock, p + sent, sizeof hello - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EAGAIN && err != EWOULDBLOCK)
      throw Error(who(c.rank) + "sending to rank " + std::to_string(peer.rank) + " failed: " + errno_text(err));
    if (const int rc = wait_fd(sock, POLLOUT, c.deadline); rc != 0) throw_wait(c, rc, "sending to", peer);
  }
}

// Reads the reply; the descriptors it carries are owned at once, so a
// malformed reply leaks none.
UniqueFd receive_fd(const Ctx& c, int sock, const FdPeer& peer) {
  const std::string from = "rank " + std::to_string(peer.rank);
  for (;;) {
    char byte = 0;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err != EAGAIN && err != EWOULDBLOCK)
        throw Error(who(c.rank) + "receiving from " + from + " failed: " + errno_text(err));
      if (const int rc = wait_fd(sock, POLLIN, c.deadline); rc != 0)
        throw_wait(c, rc, "waiting for the file descriptor of", peer);
      continue;
    }
    if (n == 0)
      throw Error(who(c.rank) + from +
                  " closed the connection without sending its file descriptor (a wrong key or rank: another job?)");
    std::vector<UniqueFd> fds;
    for (cmsghdr* h = CMSG_FIRSTHDR(&msg); h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof fd);
        fds.emplace_back(fd);
      }
    }
    if (byte != kReplyByte || fds.size() != 1 || (msg.msg_flags & MSG_CTRUNC) != 0)
      throw Error(who(c.rank) + from + " sent a malformed reply (" + std::to_string(fds.size()) + " descriptors)");
    return std::move(fds[0]);
  }
}

UniqueFd fetch(const Ctx& c, const FdPeer& peer) {
  UniqueFd sock = unix_socket(c.rank);
  connect_to(c, sock.get(), peer);
  send_hello(c, sock.get(), peer);
  return receive_fd(c, sock.get(), peer);
}

// Joins the server thread on every path; on an early exit it first tells the
// server to stop, so the join does not wait for the deadline.
class ServerJoin {
 public:
  ServerJoin(std::thread& thread, int stop) : thread_(thread), stop_(stop) {}
  ~ServerJoin() {
    if (!thread_.joinable()) return;
    const uint64_t one = 1;
    while (write(stop_, &one, sizeof one) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  ServerJoin(const ServerJoin&) = delete;
  ServerJoin& operator=(const ServerJoin&) = delete;
  // Waits for the server to serve every peer (or to time out).
  void wait() { thread_.join(); }

 private:
  std::thread& thread_;
  int stop_;
};

}  // namespace

FdExchange::FdExchange(int rank) : rank_(rank) {
  static std::atomic<uint64_t> count{0};
  std::random_device rd;
  // Another process may hold the name by chance: draw again.
  for (int attempt = 0;; ++attempt) {
    address_ = {};
    address_.key = random_u64(rd);
    std::snprintf(address_.name.data(), address_.name.size(), "turnout-fd/%d.%llu/%d/%016llx",
                  static_cast<int>(getpid()), static_cast<unsigned long long>(count++), rank,
                  static_cast<unsigned long long>(random_u64(rd)));
    UniqueFd sock = unix_socket(rank);
    sockaddr_un addr;
    const socklen_t len = abstract_address(address_, addr);
    if (bind(sock.get(), reinterpret_cast<const sockaddr*>(&addr), len) == 0) {
      if (listen(sock.get(), SOMAXCONN) != 0)
        throw Error(who(rank) + "cannot listen on '" + name_of(address_) + "': " + errno_text(errno));
      listener_ = std::move(sock);
      return;
    }
    const int err = errno;
    if (err != EADDRINUSE || attempt == 3)
      throw Error(who(rank) + "cannot bind the abstract socket '" + name_of(address_) + "': " + errno_text(err));
  }
}

std::vector<UniqueFd> FdExchange::exchange(int fd, std::span<const FdPeer> peers, milliseconds timeout) {
  std::vector<int> ranks;
  for (const FdPeer& p : peers) {
    if (p.rank == rank_ || std::find(ranks.begin(), ranks.end(), p.rank) != ranks.end())
      throw InvalidArgument(who(rank_) + "peer rank " + std::to_string(p.rank) + " is this rank or listed twice");
    ranks.push_back(p.rank);
  }
  if (!listener_) throw Error(who(rank_) + "exchange() was called before on this FdExchange");
  if (fd < 0) throw InvalidArgument(who(rank_) + "no file descriptor to give (" + std::to_string(fd) + ")");
  // Whatever happens below, no peer will need this listener again.
  const UniqueFd listener = std::move(listener_);
  if (peers.empty()) return {};
  const Ctx c{rank_, timeout, deadline_after(timeout)};
  UniqueFd stop(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop) throw Error(who(rank_) + "cannot create an eventfd: " + errno_text(errno));

  std::exception_ptr server_error;
  std::thread server([&] {
    try {
      serve(c, listener.get(), stop.get(), fd, address_.key, ranks);
    } catch (...) {
      server_error = std::current_exception();
    }
  });
  ServerJoin join(server, stop.get());
  std::vector<UniqueFd> got;
  for (const FdPeer& p : peers) got.push_back(fetch(c, p));
  join.wait();
  if (server_error) std::rethrow_exception(server_error);
  return got;
}

}  // namespace turnout
